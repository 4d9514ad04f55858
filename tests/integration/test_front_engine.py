"""The front and its engine process over real sockets: the three APIs, their errors, single-flight
loading, client disconnects and backends that crash mid-stream.

One `modelyard serve` is shared by the module; each test that changes a model's state has a model
of its own, so the tests do not depend on their order.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from tests.integration.harness import (
    APIS,
    HELLO,
    TEXT_3,
    TEXT_16,
    answer_text,
    chat_request,
    config,
    crash_once_model,
    event_text,
    leases_back,
    model_status,
    module_server,
    pid_alive,
    sse_data,
    starts,
    status,
    stream_events,
)
from tests.support import Server, fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

OLLAMA_FINAL_STATS = (
    "total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
    "eval_count", "eval_duration",
)  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, files: Path) -> Iterator[Server]:
    models = [
        fake_model("m1", aliases=["m1-alias"]),
        fake_model("idle"),  # never requested
        fake_model("cold", "--load-time-s", "1", "--start-log", str(files / "cold.starts")),
        *(fake_model(f"slow-{api}", "--tokens-per-s", "5") for api in APIS),
        *(crash_once_model(f"crashy-{api}", files) for api in APIS),
    ]
    with module_server(tmp_path_factory, config(*models)) as s:
        yield s


def post(server: Server, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30, **kw)


# --- OpenAI -------------------------------------------------------------------------------------


def test_openai_client_chat_non_stream_and_stream(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    done = client.chat.completions.create(model="m1", messages=HELLO)  # type: ignore[arg-type]
    assert done.choices[0].message.content == TEXT_16
    assert done.choices[0].finish_reason == "stop"
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (4, 16)

    chunks = list(
        client.chat.completions.create(
            model="m1",
            messages=HELLO,  # type: ignore[arg-type]
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXT_3
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3

    completion = client.completions.create(model="m1", prompt="Once upon a time", max_tokens=3)
    assert completion.choices[0].text == TEXT_3


def test_openai_raw_sse_chat_and_completions(server: Server) -> None:
    r = post(
        server,
        "/v1/chat/completions",
        {"model": "m1", "messages": HELLO, "stream": True, "max_tokens": 3,
         "stream_options": {"include_usage": True}},
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = stream_events("openai", r.text)
    assert events[-1] == "[DONE]"
    assert "".join(event_text("openai", e) for e in events) == TEXT_3
    usage = [e["usage"] for e in events[:-1] if e.get("usage")]
    assert usage == [
        {"completion_tokens": 3, "prompt_tokens": 4, "total_tokens": 7,
         "prompt_tokens_details": {"cached_tokens": 0}}
    ]

    # Without include_usage no chunk carries usage, and the stream still ends with [DONE].
    r = post(server, "/v1/chat/completions",
             {"model": "m1", "messages": HELLO, "stream": True, "max_tokens": 2})
    events = stream_events("openai", r.text)
    assert events[-1] == "[DONE]"
    assert not any(e.get("usage") for e in events[:-1])

    r = post(server, "/v1/completions", {"model": "m1", "prompt": "Once upon a", "max_tokens": 3})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == TEXT_3
    assert body["usage"]["prompt_tokens"] == 3

    r = post(
        server,
        "/v1/completions",
        {"model": "m1", "prompt": "Once upon a", "max_tokens": 3, "stream": True,
         "stream_options": {"include_usage": True}},
    )
    assert r.status_code == 200
    data = sse_data(r.text)
    assert data[-1] == "[DONE]"
    events = stream_events("openai", r.text)[:-1]
    assert "".join(c["text"] for e in events for c in e["choices"]) == TEXT_3
    assert events[-1]["usage"]["completion_tokens"] == 3


def test_openai_models_lists_configured_models(server: Server) -> None:
    r = httpx.get(server.url + "/v1/models", timeout=10)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    ids = {m["id"] for m in body["data"]}
    assert {"m1", "idle", "cold"} <= ids
    assert all(m["object"] == "model" for m in body["data"])

    # An alias resolves to the model's id.
    r = httpx.get(server.url + "/v1/models/m1-alias", timeout=10)
    assert r.status_code == 200 and r.json()["id"] == "m1"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert "m1" in {m.id for m in client.models.list()}


# --- Ollama -------------------------------------------------------------------------------------


def test_ollama_client_chat_stream_and_non_stream(server: Server) -> None:
    client = ollama.Client(host=server.url)

    done = client.chat(model="m1", messages=HELLO, stream=False)
    assert done.message.content == TEXT_16
    assert done.done is True and done.done_reason == "stop"
    assert done.eval_count == 16 and done.prompt_eval_count == 4

    parts = list(client.chat(model="m1", messages=HELLO, stream=True, options={"num_predict": 3}))
    assert "".join(p.message.content or "" for p in parts) == TEXT_3
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    last = parts[-1]
    assert last.done_reason == "length" and last.eval_count == 3
    assert last.total_duration is not None and last.total_duration > 0


def test_ollama_ndjson_chat_and_generate(server: Server) -> None:
    for path, field, body in (
        ("/api/chat", "message", {"model": "m1", "messages": HELLO}),
        ("/api/generate", "response", {"model": "m1", "prompt": "Say hello to me"}),
    ):
        # Streaming is Ollama's default: one JSON object per line.
        r = post(server, path, {**body, "options": {"num_predict": 3}})
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = stream_events("ollama", r.text)
        assert len(lines) == 4
        assert [line["done"] for line in lines] == [False, False, False, True]
        pieces = [x[field]["content"] if field == "message" else x[field] for x in lines]
        assert "".join(pieces) == TEXT_3
        final = lines[-1]
        assert final["done_reason"] == "length"
        assert final["eval_count"] == 3 and final["prompt_eval_count"] == 4
        for key in OLLAMA_FINAL_STATS:
            assert isinstance(final[key], int) and final[key] >= 0, key
        # Durations are nanoseconds: a whole request through two processes takes > 10 µs.
        assert final["total_duration"] > 10_000
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+Z", final["created_at"])

        r = post(server, path, {**body, "stream": False})
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/json")
        one = r.json()
        text = one["message"]["content"] if field == "message" else one["response"]
        assert text == TEXT_16
        assert one["done"] is True and one["done_reason"] == "stop" and one["eval_count"] == 16


def test_ollama_tags_ps_show_version(server: Server) -> None:
    assert post(server, "/api/chat", {"model": "m1", "messages": HELLO, "stream": False}).is_success

    tags = httpx.get(server.url + "/api/tags", timeout=10).json()["models"]
    assert {"m1:latest", "idle:latest", "cold:latest"} <= {t["name"] for t in tags}
    assert all(len(t["digest"]) == 64 for t in tags)

    running = httpx.get(server.url + "/api/ps", timeout=10).json()["models"]
    names = {m["name"] for m in running}
    assert "m1:latest" in names
    assert "idle:latest" not in names  # listed only once used

    r = post(server, "/api/show", {"model": "m1"})
    assert r.status_code == 200
    show = r.json()
    assert "completion" in show["capabilities"]
    assert {"details", "model_info", "template", "modified_at"} <= set(show)

    r = httpx.get(server.url + "/api/version", timeout=10)
    assert r.status_code == 200
    assert re.fullmatch(r"\d+\.\d+\.\d+", r.json()["version"])
    client = ollama.Client(host=server.url)
    assert "m1:latest" in {m.model for m in client.ps().models}
    assert "idle:latest" in {m.model for m in client.list().models}


# --- native -------------------------------------------------------------------------------------


def test_native_chat_non_stream_and_stream(server: Server) -> None:
    r = post(server, "/chat", {"model": "m1", "messages": HELLO})
    assert r.status_code == 200
    body = r.json()
    assert body["model"] == "m1"
    assert body["message"] == {"role": "assistant", "content": TEXT_16}
    assert body["done"] is True and body["done_reason"] == "stop"
    assert body["prompt_eval_count"] == 4 and body["eval_count"] == 16
    for key in ("total_duration", "load_duration", "eval_duration"):
        assert isinstance(body[key], int) and body[key] >= 0, key
    assert body["total_duration"] >= body["eval_duration"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+Z", body["created_at"])

    r = post(server, "/chat", {"model": "m1", "messages": HELLO, "stream": True, "max_tokens": 3})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = stream_events("native", r.text)
    assert [e["delta"] for e in events[:-1]] == [
        {"content": "The"}, {"content": " quick"}, {"content": " brown"}
    ]
    assert all(e["done"] is False for e in events[:-1])
    final = events[-1]
    assert final["delta"] == {} and final["done"] is True
    assert final["done_reason"] == "length" and final["eval_count"] == 3
    assert final["model"] == "m1" and final["total_duration"] > 0


def test_native_models_health_status_diag(server: Server) -> None:
    assert post(server, "/chat", {"model": "m1", "messages": HELLO}).is_success

    models = {m["model"]: m for m in httpx.get(server.url + "/models", timeout=10).json()["models"]}
    assert models["m1"]["loaded"] is True and models["m1"]["engine"] == "engine-0"
    assert models["m1"]["aliases"] == ["m1-alias"]
    assert models["idle"]["loaded"] is False

    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health["status"] == "healthy"
    assert health["engines"] == {"total": 1, "up": 1}
    assert health["uptime_seconds"] > 0
    assert health["models_cached"] >= 1

    engine = status(server)["engines"][0]
    assert engine["up"] is True and engine["name"] == "engine-0"
    assert engine["pid"] != server.proc.pid and pid_alive(engine["pid"])
    m1 = next(m for m in engine["models"] if m["model"] == "m1")
    assert m1["state"] == "ready" and m1["leases"] == 0
    assert m1["upstream"].startswith("http://127.0.0.1:")
    assert pid_alive(m1["pid"])
    # The upstream is the fake itself, answering its own /stats.
    assert httpx.get(m1["upstream"] + "/stats", timeout=10).json()["requests_completed"] >= 1

    diag = httpx.get(server.url + "/diag", timeout=10).json()
    assert diag["engines"][0]["up"] is True
    assert "devices" in diag["engines"][0]


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("api", APIS)
def test_unknown_model_is_404_in_the_api_shape(server: Server, api: str) -> None:
    path, body = chat_request(api, "no-such-model", stream=False)
    r = post(server, path, body)
    assert r.status_code == 404
    err = r.json()
    if api == "openai":
        assert set(err["error"]) == {"message", "type", "param", "code"}
        assert err["error"]["code"] == "model_not_found"
        assert err["error"]["param"] == "model"
        assert "no-such-model" in err["error"]["message"]
    elif api == "ollama":
        assert set(err) == {"error"} and isinstance(err["error"], str)
        assert "no-such-model" in err["error"]
    else:
        assert err["error"] == "model_not_found"
        assert "no-such-model" in err["message"]
        assert err["retryable"] is False


def test_unknown_model_through_the_official_clients(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nope", messages=HELLO)  # type: ignore[arg-type]
    assert caught.value.code == "model_not_found"
    with pytest.raises(ollama.ResponseError) as err:
        ollama.Client(host=server.url).chat(model="nope", messages=HELLO)
    assert err.value.status_code == 404 and "nope" in err.value.error


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {"model": "m1", "messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"model": "m1", "messages": HELLO, "max_tokens": "x"},
         "max_tokens"),
        ("/v1/completions", {"model": "m1"}, "prompt"),
        ("/api/chat", {"model": "m1", "messages": HELLO, "stream": "yes please"}, "stream"),
        ("/api/generate", {"model": 7, "prompt": "hi"}, "model"),
        ("/chat", {"model": "m1", "messages": HELLO, "max_tokens": "many"}, "max_tokens"),
        ("/chat", {"messages": HELLO}, "model"),
    ],
)
def test_wrong_types_are_400_naming_the_field(
    server: Server, path: str, body: dict[str, Any], field: str
) -> None:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()
    if path.startswith("/v1/"):
        assert err["error"]["code"] == "invalid_request"
        assert err["error"]["param"] == field
    elif path.startswith("/api/"):
        assert err["error"].startswith(field)
    else:
        assert err["error"] == "invalid_request" and err["param"] == field
        assert field in err["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat", "/api/generate", "/chat"])
def test_malformed_json_is_400(server: Server, path: str) -> None:
    for raw in (b'{"model": "m1", "messages": [', b"[1, 2]"):
        r = httpx.post(server.url + path, content=raw, timeout=10,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        text = r.text.lower()
        assert "json" in text
        if path.startswith("/v1/"):
            assert r.json()["error"]["code"] == "invalid_request"


def test_upstream_4xx_passes_through_unchanged(server: Server) -> None:
    # The front does not validate max_completion_tokens; the backend does, with its own 400.
    body = {"model": "m1", "messages": HELLO, "max_completion_tokens": "lots"}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400
    assert r.json() == {
        "error": {"code": 400, "message": "max_tokens must be an integer",
                  "type": "invalid_request_error"}
    }


def test_unknown_route_is_404_and_wrong_method_405(server: Server) -> None:
    r = httpx.get(server.url + "/v1/nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.url + "/api/nope", timeout=10)
    assert r.status_code == 404 and set(r.json()) == {"error"}
    r = httpx.get(server.url + "/nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    r = httpx.get(server.url + "/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


# --- loading, leases, crashes -------------------------------------------------------------------


async def test_concurrent_cold_requests_share_one_load(server: Server, files: Path) -> None:
    requests = [chat_request(api, "cold", stream=s) for api in APIS for s in (False, True)]
    assert model_status(server, "cold") is None  # never asked for yet: cold
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        responses = await asyncio.gather(*(client.post(p, json=b) for p, b in requests))
    assert [r.status_code for r in responses] == [200] * 6, [r.text for r in responses]
    for (path, body), r in zip(requests, responses, strict=True):
        api = {"/v1/chat/completions": "openai", "/api/chat": "ollama", "/chat": "native"}[path]
        if body["stream"]:
            text = "".join(event_text(api, e) for e in stream_events(api, r.text))
        else:
            text = answer_text(api, r.json())
        assert text == TEXT_16, (path, r.text)
    # One process was started for all six, and each of them waited for that load (~1 s).
    pids = starts(files / "cold.starts")
    assert len(pids) == 1
    cold = leases_back(server, "cold")  # (a lease may linger 20 ms: the fresh-clone CI's failure)
    assert (cold["pid"], cold["state"]) == (pids[0], "ready")
    native = [r.json() for (p, b), r in zip(requests, responses, strict=True)
              if p == "/chat" and not b["stream"]]
    assert native[0]["load_duration"] > 0.5e9


@pytest.mark.parametrize("api", APIS)
def test_client_disconnect_cancels_upstream_and_releases_lease(server: Server, api: str) -> None:
    model = f"slow-{api}"  # 5 tokens/s: 500 tokens would take 100 s
    path, body = chat_request(api, model, stream=True, max_tokens=500)
    received = ""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept referenced: a dropped iterator closes the connection
            for line in lines:
                received += line
                if "quick" in received:  # the second token
                    break
            leased = model_status(server, model)
            assert leased is not None and leased["leases"] == 1
        # leaving the block closes the connection mid-stream
        del lines
    upstream = leased["upstream"]

    def cancelled() -> dict[str, Any] | None:
        stats = httpx.get(upstream + "/stats", timeout=10).json()
        return stats if stats["requests_cancelled"] == 1 and stats["active"] == 0 else None

    stats = poll(cancelled, timeout_s=10, what="the backend to see the request cancelled")
    assert stats["requests_started"] == 1 and stats["requests_completed"] == 0
    poll(lambda: model_status(server, model)["leases"] == 0, timeout_s=10, what="lease released")
    # The model stays loaded and serves the next request.
    path, body = chat_request(api, model, stream=False, max_tokens=1)
    r = post(server, path, body)
    assert r.status_code == 200 and answer_text(api, r.json()) == "The"


@pytest.mark.parametrize("api", APIS)
def test_crash_mid_stream_is_an_in_band_error_then_the_model_reloads(
    server: Server, files: Path, api: str
) -> None:
    model = f"crashy-{api}"  # its first process exits after 3 tokens
    path, body = chat_request(api, model, stream=True, max_tokens=10)
    t0 = time.monotonic()
    with httpx.stream("POST", server.url + path, json=body, timeout=30) as r:
        assert r.status_code == 200  # the first byte went out before the crash
        raw = r.read().decode()  # returns: the front closes the stream after the error
    assert time.monotonic() - t0 < 10
    events = stream_events(api, raw)
    assert "".join(event_text(api, e) for e in events) == TEXT_3
    last = events[-1]
    if api == "openai":
        assert "[DONE]" not in events
        assert last["error"]["code"] == "upstream_error"
        assert model in last["error"]["message"]
    elif api == "ollama":
        assert set(last) == {"error"} and model in last["error"]
        assert not any(e.get("done") for e in events)
    else:
        assert last["error"] == "upstream_error" and model in last["message"]
        assert not any(e.get("done") for e in events)
    [crashed] = starts(files / f"{model}.starts")
    poll(lambda: not pid_alive(crashed), timeout_s=5, what="the crashed backend to be gone")

    # The very next request reloads the model and succeeds.
    path, body = chat_request(api, model, stream=False)
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    assert answer_text(api, r.json()) == TEXT_16
    first, second = starts(files / f"{model}.starts")
    assert second != first
    st = model_status(server, model)
    assert st is not None and st["pid"] == second and st["restarts"] == 1
