"""The front sends a request to where its model was last granted while the lease is confirmed.

Each client request must still reach the backend exactly once, and a stale guess (the model was
reloaded on another port) must be dropped, never answered from.
"""

from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.harness import (
    config,
    crash_once_model,
    leases_back,
    model_status,
    pid_alive,
)
from tests.support import fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _stats(upstream: str) -> dict[str, int]:
    return dict(httpx.get(upstream + "/stats").json())


def test_each_request_reaches_the_backend_once(start_server: Any) -> None:
    server = start_server(config(fake_model("m")))
    for _ in range(6):
        r = httpx.post(server.url + "/v1/chat/completions", json=BODY)
        assert r.status_code == 200, r.text
    model = model_status(server, "m")
    assert model is not None
    stats = poll(lambda: (s := _stats(model["upstream"]))["active"] == 0 and s, what="idle")
    assert stats["requests_started"] == 6
    assert stats["requests_completed"] == 6 and stats["requests_cancelled"] == 0
    leases_back(server, "m")


def test_a_stale_guess_is_dropped_for_the_granted_upstream(
    start_server: Any, tmp_path: Path
) -> None:
    spec = crash_once_model("m", tmp_path)
    spec["argv"] += ["--tokens-per-s", "10"]  # slow enough to look at it before it crashes
    server = start_server(config(spec))
    stream = {**BODY, "stream": True, "max_tokens": 10}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=stream) as r:
        old = model_status(server, "m")
        text = r.read().decode()
    assert "upstream_error" in text  # the first process crashed mid-stream
    assert old is not None and old["upstream"] is not None
    old_pid = old["pid"]
    poll(lambda: not pid_alive(old_pid), what="the crashed backend to be gone")
    # The front's guess is the dead upstream; the engine reloads and grants a new one.
    r = httpx.post(server.url + "/v1/chat/completions", json=BODY)
    assert r.status_code == 200, r.text
    new = model_status(server, "m")
    assert new is not None and new["upstream"] != old["upstream"]
    assert _stats(new["upstream"])["requests_started"] == 1
