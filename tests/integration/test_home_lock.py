"""One front per MODELYARD_HOME, one engine per index in it (issue 31, home_lock.py).

A second `modelyard serve` on a home in use came up silently beside the first, both writing its
SQLite database, its logs and its engines' files. Now it exits 1 naming the running one; the lock
is the kernel's, so it is gone the moment its holder is (even killed with SIGKILL). Several fronts
on one PostgreSQL database keep their own homes (tests/integration/test_several_fronts.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tests.integration.harness import config, pid_alive, status
from tests.support import Server, fake_model, free_port, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def serve(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`modelyard serve` on `home`, expected to give up at once (a process that keeps serving
    is killed after 30 s and fails the test)."""
    return subprocess.run(
        [sys.executable, "-m", "modelyard", "serve", "--config", str(home / "config.yaml"),
         *args],
        env={**os.environ, "MODELYARD_HOME": str(home), **env}, capture_output=True, text=True,
        timeout=30,
    )


def test_a_second_front_on_a_home_in_use_is_refused_until_the_first_is_gone(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    first = Server(home, config(fake_model("m1")))
    try:
        first.wait_healthy()
        second = serve(home, "--port", str(free_port()))
        assert second.returncode == 1, second.stdout + second.stderr
        assert f"pid {first.proc.pid}, front http://127.0.0.1:{first.port}" in second.stderr
        assert "MODELYARD_HOME is in use" in second.stderr
        assert status(first)["engines"][0]["up"], "the first front is undisturbed"

        # Killed outright, it leaves the lock file behind, but not the lock.
        engine_pid = int(status(first)["engines"][0]["pid"])
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        poll(lambda: not pid_alive(engine_pid), what="the engine to die with its front")
        assert (home / "run" / "front.lock").exists()
    finally:
        first.stop()
    again = Server(home, config(fake_model("m1")))
    try:
        again.wait_healthy()
    finally:
        again.stop()


def test_a_second_engine_with_the_same_index_on_a_home_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    front = Server(home, config(fake_model("m1")))
    try:
        front.wait_healthy()
        engine_pid = int(status(front)["engines"][0]["pid"])
        twin = serve(home, "--engine-only", "--internal-port", str(free_port()),
                     "--engine-index", "0", MODELYARD_ENGINE_SECRET="s" * 32)
        assert twin.returncode == 1, twin.stdout + twin.stderr
        assert f"pid {engine_pid}, engine-0 on port" in twin.stderr
        assert status(front)["engines"][0]["up"]
    finally:
        front.stop()
