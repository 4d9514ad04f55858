"""Loads that go wrong (DESIGN.md §3.6): a child that crashes while loading, one that stalls in
silence, and a slow one that keeps logging progress and must not be cut short.

One server, with a short stall timeout and a long cooldown, serves every model here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.harness import (
    HELLO,
    TEXT_16,
    config,
    model_status,
    module_server,
    pid_alive,
    starts,
)
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

COOLDOWN_S = 30.0
STALL_S = 1.5
PROGRESS_LOAD_S = 3.0  # twice the stall timeout, with a progress line every 0.2 s


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, files: Path) -> Iterator[Server]:
    models = [
        fake_model("broken", "--crash-on-load", "--start-log", str(files / "broken.starts")),
        fake_model("stall", "--silent-stall", "--start-log", str(files / "stall.starts")),
        fake_model("progress", "--progress-while-loading", "--load-time-s", str(PROGRESS_LOAD_S),
                   "--start-log", str(files / "progress.starts")),
    ]
    cfg = config(*models, load_cooldown_s=COOLDOWN_S, load_stall_timeout_s=STALL_S,
                 stop_grace_s=1.0)
    with module_server(tmp_path_factory, cfg) as s:
        yield s


def post(server: Server, path: str, body: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def test_crash_on_load_is_503_with_the_log_tail_then_a_fast_cooldown(
    server: Server, files: Path
) -> None:
    body = {"model": "broken", "messages": HELLO}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "model_load_failed" and err["type"] == "server_error"
    message = err["message"]
    assert "exited with status 1" in message
    # The child's own last log lines explain why.
    assert "fake: simulated load failure" in message
    assert "exiting due to model loading error" in message
    assert 0 < int(r.headers["retry-after"]) <= COOLDOWN_S
    [pid] = starts(files / "broken.starts")
    assert not pid_alive(pid)

    # Within load_cooldown_s: answered at once, explained, and no new process is spawned.
    t0 = time.monotonic()
    r = post(server, "/chat", body)
    elapsed = time.monotonic() - t0
    assert r.status_code == 503
    assert elapsed < 1.0
    native = r.json()
    assert native["error"] == "model_load_failed" and native["retryable"] is True
    assert "load_cooldown_s" in native["message"]
    assert any("simulated load failure" in line for line in native["log_tail"])
    assert 0 < native["retry_after_s"] <= COOLDOWN_S
    assert 0 < int(r.headers["retry-after"]) <= COOLDOWN_S

    r = post(server, "/api/chat", {**body, "stream": False})
    assert r.status_code == 503
    assert set(r.json()) == {"error"} and "simulated load failure" in r.json()["error"]
    assert "retry-after" in r.headers

    assert starts(files / "broken.starts") == [pid]
    st = model_status(server, "broken")
    assert st is not None and st["state"] == "failed" and st["cooldown_s"] > 0
    assert "failed to load" in st["last_error"]


def test_silent_stall_fails_after_the_stall_timeout(server: Server, files: Path) -> None:
    t0 = time.monotonic()
    r = post(server, "/v1/chat/completions", {"model": "stall", "messages": HELLO})
    elapsed = time.monotonic() - t0
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "model_load_failed"
    assert "stalled" in err["message"]
    assert STALL_S <= elapsed < STALL_S + 10
    # The stalled child was stopped, not left behind.
    [pid] = starts(files / "stall.starts")
    assert not pid_alive(pid)


def test_progress_while_loading_resets_the_stall_deadline(server: Server, files: Path) -> None:
    t0 = time.monotonic()
    r = post(server, "/v1/chat/completions", {"model": "progress", "messages": HELLO})
    elapsed = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == TEXT_16
    # It logged progress but stayed unready past the stall timeout, and still loaded.
    assert elapsed >= PROGRESS_LOAD_S > STALL_S
    assert len(starts(files / "progress.starts")) == 1
    log = (server.home / "logs" / "models" / "progress.log").read_text()
    assert log.count("fake: loading progress") >= PROGRESS_LOAD_S / 0.2 - 2
