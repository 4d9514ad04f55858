"""Request ids: answered to the client, logged by the front and the engine, sent to the backend;
and `--log-format json` writes one JSON object per line in every process."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from tests.integration.harness import HELLO, config
from tests.support import Server, fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("rid"), config(fake_model("m1")), "--log-format", "json")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_a_request_id_follows_the_request_through_every_process(server: Server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   headers={"X-Request-Id": "trace-me-42"},
                   json={"model": "m1", "messages": HELLO, "max_tokens": 3})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-me-42"
    engine_log = server.home / "logs" / "engine-0.log"
    # The engine loaded m1 for this request: its records of that load carry the id.
    loading = poll(lambda: [e for e in json_lines(engine_log.read_text())
                            if e.get("request_id") == "trace-me-42"],
                   timeout_s=10, what="the engine's records of the request")
    assert all(e["process"] == "engine-0" and e["level"] in ("info", "debug", "warning")
               for e in loading)
    assert any("m1" in str(e["message"]) for e in loading)
    model_log = server.home / "logs" / "models" / "m1.log"
    poll(lambda: "fake: request trace-me-42 on /v1/chat/completions" in model_log.read_text(),
         timeout_s=10, what="the backend to see the id")


def test_ids_are_made_when_missing_or_unsafe(server: Server) -> None:
    made = httpx.get(server.url + "/health", timeout=10).headers["x-request-id"]
    assert len(made) == 16 and int(made, 16) >= 0
    unsafe = httpx.get(server.url + "/health", headers={"X-Request-Id": "a b\tc" + "x" * 80},
                       timeout=10).headers["x-request-id"]
    assert unsafe != made and " " not in unsafe and len(unsafe) == 16
    refused = httpx.get(server.url + "/admin/engines", headers={"X-Request-Id": "denied-1"},
                        timeout=10)
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "denied-1"


def test_json_log_lines_in_the_front(server: Server) -> None:
    front = json_lines((server.home / "logs" / "modelyard.log").read_text())
    assert front and all(set(e) >= {"ts", "level", "logger", "process", "message"}
                         for e in front)
    assert {e["process"] for e in front} == {"front"}
