"""Logs a local user cannot grow without bound (issue 31).

Any local user could connect to an engine's lease channel and send a wrong hello, thousands of
times a second: each refusal was a line in `logs/engine-0.log` (about 15 KB/s), and that file,
held open by the running engine, was only rotated when the engine restarted. Now the refusal is
logged once per REFUSED_LOG_EVERY_S, and a running child's log is rotated by size (copytruncate).
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.integration.harness import config, engine_access, module_server
from tests.integration.test_engine_auth import raw_http
from tests.support import Server, fake_model, poll

from modelyard.proc.process import ChildProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

REFUSED = "a connection without the engine's secret was refused"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with module_server(tmp_path_factory, config(fake_model("m1"))) as s:
        yield s


def test_refused_hellos_are_logged_once_per_interval(server: Server) -> None:
    port, secret, _ = engine_access(server)
    _, health = raw_http(port, "GET", "/health", {"Host": f"127.0.0.1:{port}",
                                                  "Authorization": f"Bearer {secret}"})
    lease_port = int(health["lease_port"])
    log = server.home / "logs" / "engine-0.log"
    for _ in range(200):
        with socket.create_connection(("127.0.0.1", lease_port), timeout=10) as sock:
            sock.sendall(b'{"op": "hello", "secret": "guess", "protocol": 1}\n')
            assert sock.recv(100) == b""  # closed without a word, once the line was judged
    poll(lambda: REFUSED in log.read_text(), what="the first refusal logged")
    # 200 refusals well within one interval: one line (two if the flood straddled an interval);
    # before the throttle, each refusal wrote its own line (200).
    logged = log.read_text().count(REFUSED)
    assert logged in (1, 2), f"{logged} lines for 200 refused hellos"


def test_a_running_childs_log_is_rotated_by_size(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    # A real child that writes ~100 KB/s into its (appended) log for as long as it lives.
    writer = ("import sys, time\n"
              "while True:\n"
              "    sys.stdout.write('x' * 99 + '\\n'); sys.stdout.flush(); time.sleep(0.001)\n")

    async def scenario() -> None:
        child = ChildProcess([sys.executable, "-c", writer], name="w", log_file=log,
                             log_max_bytes=32 * 1024, log_backups=2)
        await child.start()
        try:
            progress = []
            for _ in range(200):  # up to 20 s: the third rotation has come
                await asyncio.sleep(0.1)
                progress.append(child.output_bytes())
                if log.with_name("child.log.2").exists():
                    break
            assert child.alive, "the child must still be running: nothing restarted it"
            assert log.with_name("child.log.1").exists() and log.with_name("child.log.2").exists()
            assert not log.with_name("child.log.3").exists()  # backups: 2
            # The copy is as private as a log under a private umask, whatever this one is.
            assert log.with_name("child.log.1").stat().st_mode & 0o077 == 0
            # The child kept writing into the truncated file: under the cap plus one check's
            # growth (~100 KB/s for LOG_CHECK_S), not the whole run's output.
            assert log.stat().st_size < 32 * 1024 + 200 * 1024
            assert log.with_name("child.log.1").read_bytes().startswith(b"x" * 99 + b"\n")
            # Progress (stall deadlines) keeps growing across rotations.
            assert progress == sorted(progress) and progress[-1] > 64 * 1024
        finally:
            await child.stop(5)

    asyncio.run(scenario())
