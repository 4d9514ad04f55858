"""Live logs through a real `modelyard serve` (engine processes and --single-process): the model's
log shows its fake backend's lines, the engine's log its loads, the stream delivers a line written
after it opened, and an unknown source is a 404 that names it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from tests.integration.harness import config, module_server
from tests.support import Server, fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

LOADED = "fake: model loaded"  # tests/fakes/fake_backend.py prints it once ready


@pytest.fixture(scope="module", params=["engine-process", "single-process"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Server]:
    args = ("--single-process",) if request.param == "single-process" else ()
    cfg = config(fake_model("logs-chat"), fake_model("logs-stream"))
    with module_server(tmp_path_factory, cfg, *args) as s:
        yield s


def admin(server: Server) -> dict[str, str]:
    """The CLI's admin token, once first boot has written it (admin routes need it)."""
    token_file = server.home / "cli-token"
    if not token_file.exists():
        return {}
    return {"Authorization": f"Bearer {token_file.read_text().strip()}"}


def get_logs(server: Server, **params: Any) -> dict[str, Any]:
    r = httpx.get(server.url + "/admin/logs", params=params, headers=admin(server), timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def texts(body: dict[str, Any]) -> list[str]:
    return [line["text"] for line in body["lines"]]


def chat(server: Server, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


def test_model_and_engine_logs_after_a_chat(server: Server) -> None:
    chat(server, "logs-chat")
    model_log = poll(lambda: LOADED in texts(get_logs(server, model="logs-chat")) and
                     get_logs(server, model="logs-chat"), what="the fake's lines")
    assert all(line["source"] == "logs-chat" for line in model_log["lines"])
    seqs = [line["seq"] for line in model_log["lines"]]
    assert seqs == sorted(seqs)
    # `after` the last seq: nothing new yet
    assert get_logs(server, model="logs-chat", after=seqs[-1])["lines"] == []
    sources = {s["name"]: s for s in model_log["sources"]}
    assert sources["front"]["kind"] == "front"
    assert sources["engine-0"]["kind"] == "engine"
    assert sources["logs-chat"] == {**sources["logs-chat"], "kind": "model", "engine": "engine-0"}
    assert sources["logs-stream"]["engine"] is None  # not loaded

    # the engine logged the load (its own file, or this process's records with --single-process)
    poll(lambda: any("loading logs-chat" in t for t in texts(get_logs(server, engine="engine-0"))),
         what="the engine's load line")
    engine_lines = get_logs(server, engine="engine-0")["lines"]
    assert any(line["level"] == "info" and line["ts"] for line in engine_lines)
    assert get_logs(server)["source"] == "front"


def test_stream_delivers_lines_written_after_it_opened(server: Server) -> None:
    headers = {**admin(server), "Accept": "text/event-stream"}
    url = server.url + "/admin/logs/stream"
    loader = threading.Thread(target=chat, args=(server, "logs-stream"))
    with httpx.stream("GET", url, params={"model": "logs-stream"}, headers=headers,
                      timeout=httpx.Timeout(10, read=60)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(lines)  # the stream is open (the model was never started: no lines yet)
        assert first.startswith(":"), first
        loader.start()  # now the fake starts and writes its log
        seen = []
        for raw in lines:
            if raw.startswith("data:"):
                event = orjson.loads(raw[5:])
                seen.append(event["text"])
                assert event["source"] == "logs-stream"
                if event["text"] == LOADED:
                    break
    loader.join(30)
    assert LOADED in seen


def test_unknown_sources_are_404(server: Server) -> None:
    for path in ("/admin/logs", "/admin/logs/stream"):
        r = httpx.get(server.url + path, params={"engine": "engine-7"}, headers=admin(server),
                      timeout=10)
        assert r.status_code == 404, r.text
        assert "engine-7" in r.json()["message"]
        r = httpx.get(server.url + path, params={"model": "no-such-model"},
                      headers=admin(server), timeout=10)
        assert r.status_code == 404, r.text
        assert r.json()["error"] == "model_not_found"
        assert "no-such-model" in r.json()["message"]
