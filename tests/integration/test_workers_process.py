"""`modelyard serve --workers 2` (issue 33 item 4): two front processes on one port, one set of
engines, one lock on the home; a dead worker comes back; SIGTERM stops them all.

Which worker answered is in every answer's X-Modelyard-Worker header (`index/count`); the
kernel spreads new connections over the workers, so a test sends each request on a connection
of its own until both have answered."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.harness import HELLO, config, pid_alive, status
from tests.integration.test_home_lock import serve
from tests.support import Server, fake_model, free_port, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

HEADER = "x-modelyard-worker"


@pytest.fixture
def two_workers(tmp_path: Path) -> Iterator[Server]:
    server = Server(tmp_path / "home", config(fake_model("m1")), "--workers", "2")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def from_each_worker(send: Callable[[httpx.Client], httpx.Response], *, tries: int = 200,
                     ) -> dict[str, httpx.Response]:
    """`send` on fresh connections until both workers have answered: the answer of each."""
    seen: dict[str, httpx.Response] = {}
    for _ in range(tries):
        with httpx.Client(timeout=30) as client:
            r = send(client)
        seen.setdefault(r.headers[HEADER], r)
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only workers {sorted(seen)} answered in {tries} requests")


def chat(server: Server, client: httpx.Client, **extra: Any) -> httpx.Response:
    return client.post(server.url + "/v1/chat/completions",
                       json={"model": "m1", "messages": HELLO, "max_tokens": 4, **extra})


def test_both_workers_answer_on_one_port_from_the_same_engine(two_workers: Server) -> None:
    answers = from_each_worker(lambda c: chat(two_workers, c))
    assert sorted(answers) == ["0/2", "1/2"]
    assert all(r.status_code == 200 for r in answers.values()), answers
    # One engine, one model process: the second worker leased the model the first loaded.
    engines = status(two_workers)["engines"]
    assert len(engines) == 1
    [model] = [m for m in engines[0]["models"] if m["model"] == "m1"]
    assert model["state"] == "ready"


def test_the_home_admits_its_workers_and_refuses_an_unrelated_serve(
    two_workers: Server,
) -> None:
    second = serve(two_workers.home, "--port", str(free_port()), "--workers", "2")
    assert second.returncode == 1, second.stdout + second.stderr
    assert "MODELYARD_HOME is in use" in second.stderr
    # A forged token (a descriptor that is not the supervisor's lock) is refused too.
    forged = serve(two_workers.home, "--port", str(free_port()), "--workers", "2",
                   MODELYARD_WORKER_TOKEN='{"index": 1, "count": 2, "socket_fd": 0, '
                   '"lock_fd": 2, "secret": "x"}')
    assert forged.returncode == 1, forged.stdout + forged.stderr
    assert "refusing to start a worker" in forged.stderr


def worker_pid(server: Server) -> int:
    found = [line for line in server.output().splitlines() if "worker-1 started (pid" in line]
    return int(found[-1].rsplit("pid ", 1)[1].rstrip(")"))


def test_a_dead_worker_is_restarted_and_sigterm_stops_every_process(two_workers: Server,
                                                                     ) -> None:
    first = poll(lambda: "worker-1 started" in two_workers.output() and worker_pid(two_workers),
                 what="worker-1 to start")
    os.kill(first, signal.SIGKILL)
    again = poll(lambda: (p := worker_pid(two_workers)) != first and p, timeout_s=30,
                 what="worker-1 to be restarted")
    answers = from_each_worker(lambda c: chat(two_workers, c))
    assert all(r.status_code == 200 for r in answers.values())
    engine_pid = int(status(two_workers)["engines"][0]["pid"])

    assert two_workers.stop() == 0 or two_workers.proc.returncode is not None
    poll(lambda: not pid_alive(again) and not pid_alive(engine_pid),
         what="the worker and the engine to stop with the supervisor")


def test_status_shows_every_worker_and_a_restart_from_either_worker(two_workers: Server,
                                                                    ) -> None:
    def workers_seen() -> dict[str, Any]:
        """/status's `workers` as each worker answers it (the same file behind both)."""
        answers = from_each_worker(lambda c: c.get(two_workers.url + "/status",
                                                   headers=two_workers.admin_headers))
        return {worker: r.json()["workers"] for worker, r in answers.items()}

    first = poll(lambda: "worker-1 started" in two_workers.output() and worker_pid(two_workers),
                 what="worker-1 to start")
    def started_seen() -> dict[str, Any] | None:
        found = workers_seen()
        return found if all(s[1]["pid"] == first for s in found.values()) else None

    seen = poll(started_seen, what="worker-1 in /status")
    for states in seen.values():
        assert [(s["index"], s["alive"], s["restarts"]) for s in states] == [
            (0, True, 0), (1, True, 0)]
        assert states[1]["pid"] == first and states[1]["last_exit"] is None
    os.kill(first, signal.SIGKILL)
    again = poll(lambda: (p := worker_pid(two_workers)) != first and p, timeout_s=30,
                 what="worker-1 to be restarted")
    def restarted_seen() -> dict[str, Any] | None:
        found = workers_seen()
        return found if all(s[1]["pid"] == again for s in found.values()) else None

    seen = poll(restarted_seen, timeout_s=30, what="the restarted worker-1 in /status")
    for states in seen.values():
        restarted = states[1]
        assert restarted["alive"] and restarted["restarts"] == 1
        assert restarted["last_exit"] == -signal.SIGKILL  # how it died
