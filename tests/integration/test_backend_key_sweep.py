"""Key files of backends that died with their engine are swept (issue 31, keys.py).

A backend's key file (`run/backend-keys/*.key`, llama-server's `--api-key-file`) is removed when
its load ends or its server exits while the engine watches. An engine killed outright takes its
servers with it (PR_SET_PDEATHSIG) and nobody removed their files: here a real engine process is
SIGKILLed under a loaded model, and the engine its front restarts sweeps the file."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import httpx
import pytest
from tests.integration.harness import HELLO, config, model_status, pid_alive, status
from tests.support import Server, fake_model, poll

from modelyard.engine.backends.keys import key_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def chat(server: Server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "m", "messages": HELLO, "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_keys_of_servers_that_died_with_a_killed_engine_are_swept(tmp_path: Path) -> None:
    server = Server(tmp_path / "home", config(fake_model("m")))
    try:
        server.wait_healthy()
        chat(server)
        [key] = key_dir(server.home).glob("*.key")
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        backend = model_status(server, "m")
        assert backend is not None
        backend_pid, engine_pid = int(backend["pid"]), int(status(server)["engines"][0]["pid"])

        os.kill(engine_pid, signal.SIGKILL)
        poll(lambda: not pid_alive(backend_pid), what="the backend to die with its engine")

        def restarted() -> bool:
            engine = status(server)["engines"][0]
            return bool(engine["up"]) and engine["pid"] not in (None, engine_pid)

        poll(restarted, timeout_s=60, what="the front to restart its engine")
        poll(lambda: not key.exists(), what="the dead load's key file to be swept")
        chat(server)  # and the model loads again, with a fresh key
        [fresh] = key_dir(server.home).glob("*.key")
        assert fresh != key
    finally:
        server.stop()
    assert not list(key_dir(server.home).glob("*.key")), "a clean stop leaves no key"
