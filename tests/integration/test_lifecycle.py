"""Process lifecycle: an engine killed under the front, a child that ignores SIGTERM when the
server stops, and `--single-process` mode. Each test needs a server of its own."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import httpx
import pytest
from tests.integration.harness import (
    HELLO,
    TEXT_16,
    config,
    model_status,
    parent_pid,
    pid_alive,
    status,
)
from tests.support import fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def chat(url: str, model: str = "m1") -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": model, "messages": HELLO},
                      timeout=30)


def health(url: str) -> str:
    return str(httpx.get(url + "/health", timeout=10).json()["status"])


def test_killed_engine_is_503_until_restarted_and_its_child_dies_with_it(
    start_server: Any,
) -> None:
    # The supervisor waits engine_restart_backoff_s before restarting: a window of >= 1 s.
    server = start_server(config(fake_model("m1"), engine_restart_backoff_s=1.0))
    assert chat(server.url).status_code == 200
    engine = status(server)["engines"][0]
    engine_pid = engine["pid"]
    child_pid = model_status(server, "m1")["pid"]
    assert parent_pid(child_pid) == engine_pid

    os.kill(engine_pid, signal.SIGKILL)
    poll(lambda: not pid_alive(engine_pid), timeout_s=5, what="the engine to die")
    # PR_SET_PDEATHSIG: the engine's llama-server does not outlive it.
    poll(lambda: not pid_alive(child_pid), timeout_s=5, what="the engine's child to die")
    poll(lambda: health(server.url) == "degraded", timeout_s=5, what="/health degraded")

    r = chat(server.url)
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "engine_unavailable"
    assert int(r.headers["retry-after"]) >= 1
    assert status(server)["engines"][0]["up"] is False
    r = httpx.post(server.url + "/api/chat", json={"model": "m1", "messages": HELLO}, timeout=30)
    assert r.status_code == 503 and "retry-after" in r.headers
    assert "restart" in r.json()["error"]

    # The supervisor restarts the engine; the model loads again on demand.
    poll(lambda: health(server.url) == "healthy", timeout_s=30, what="/health healthy again")
    new_engine_pid = status(server)["engines"][0]["pid"]
    assert new_engine_pid != engine_pid and pid_alive(new_engine_pid)
    r = chat(server.url)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == TEXT_16
    new_child = model_status(server, "m1")["pid"]
    assert new_child != child_pid and parent_pid(new_child) == new_engine_pid


def test_stop_escalates_to_sigkill_for_a_child_that_ignores_sigterm(start_server: Any) -> None:
    grace_s = 0.5
    server = start_server(
        config(fake_model("stubborn", "--ignore-sigterm"), stop_grace_s=grace_s)
    )
    assert chat(server.url, "stubborn").status_code == 200
    engine_pid = status(server)["engines"][0]["pid"]
    child_pid = model_status(server, "stubborn")["pid"]

    t0 = time.monotonic()
    os.killpg(server.proc.pid, signal.SIGTERM)  # what Ctrl-C / systemd stop would do
    poll(lambda: not pid_alive(child_pid), timeout_s=15, what="the stubborn child to be killed")
    killed_after = time.monotonic() - t0
    server.proc.wait(15)
    assert not pid_alive(engine_pid)
    # It outlived SIGTERM for the grace, then SIGKILL came: well before the front would give
    # up on the engine (2 * grace + 5 s) and kill it, which would end the child by PDEATHSIG.
    assert grace_s <= killed_after < 4.0, killed_after
    log = (server.home / "logs" / "models" / "stubborn.log").read_text()
    assert "cleaning up before exit" not in log  # it never ran a TERM handler


def test_single_process_serves_chat(start_server: Any) -> None:
    server = start_server(config(fake_model("m1")), "--single-process")
    r = chat(server.url)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == TEXT_16
    r = httpx.post(server.url + "/api/chat",
                   json={"model": "m1", "messages": HELLO, "stream": False}, timeout=30)
    assert r.status_code == 200 and r.json()["message"]["content"] == TEXT_16
    # The engine is the front's own process: the backend is its direct child.
    engine = status(server)["engines"][0]
    assert engine["pid"] == server.proc.pid
    child_pid = model_status(server, "m1")["pid"]
    assert parent_pid(child_pid) == server.proc.pid
    server.stop()
    assert not pid_alive(child_pid)
