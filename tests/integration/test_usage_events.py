"""Usage comes from the backend's own usage, through the request's events (issue 33 item 2),
through a real `modelyard serve` over the fake llama-server: for each kind of request (OpenAI
chat streamed without and with include_usage, non-streamed, Ollama /api/chat streamed, Anthropic
messages streamed, embeddings) the prompt, completion and cached tokens of its activity record
equal what the backend answered (its GET /usages), and so do the sums in /metrics and the usage
API; and a client that did not ask include_usage gets, byte for byte, the stream the backend
sends without it (asked upstream, stripped again: no usage chunk, llama-server's `timings` where
they were)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.integration.harness import HELLO, config, model_status, module_server
from tests.support import Server, fake_model, poll

from modelyard.engine.backends.keys import key_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

CFG = config(fake_model("m", "--parallel", "1"), fake_model("e", "--embeddings"),
             fake_model("short", "--ctx-size", "4"))
CHAT = {"model": "m", "messages": HELLO, "max_tokens": 5}
LONG = {"model": "short", "messages": [{"role": "user", "content": "one two three four five six"}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with module_server(tmp_path_factory, CFG, "--single-process") as server:
        yield server


def upstream(server: Server, model: str) -> str:
    found = model_status(server, model)
    assert found is not None and found["upstream"], found
    return str(found["upstream"])


def backend_usage(server: Server, model: str) -> dict[str, int]:
    """What the backend reported for the last answer it finished."""
    usages = httpx.get(upstream(server, model) + "/usages", timeout=10).json()
    return dict(usages[-1])


def stream(server: Server, path: str, body: dict[str, Any]) -> tuple[str, bytes]:
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return r.headers["x-request-id"], r.read()


def whole(server: Server, path: str, body: dict[str, Any]) -> str:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["x-request-id"]


REQUESTS: dict[str, Any] = {
    "openai stream": lambda s: stream(s, "/v1/chat/completions", {**CHAT, "stream": True})[0],
    "openai stream include_usage": lambda s: stream(s, "/v1/chat/completions", {
        **CHAT, "stream": True, "stream_options": {"include_usage": True}})[0],
    "openai whole": lambda s: whole(s, "/v1/chat/completions", CHAT),  # the lane (lane.py)
    # The same, off the lane (`n` is not a plain field): through the route and the pipeline.
    "openai whole, routed": lambda s: whole(s, "/v1/chat/completions", {**CHAT, "n": 1}),
    "ollama stream": lambda s: stream(s, "/api/chat", {
        "model": "m", "messages": HELLO, "options": {"num_predict": 5}})[0],
    "anthropic stream": lambda s: stream(s, "/v1/messages", {
        "model": "m", "messages": HELLO, "max_tokens": 5, "stream": True})[0],
}


@pytest.fixture(scope="module")
def answered(server: Server) -> dict[str, tuple[str, str, dict[str, int]]]:
    """Each kind twice (the second finds its prompt cached in the backend's slot): its request
    id, its model and the backend's own usage for it."""
    out = {}
    for name, send in REQUESTS.items():
        for turn in (1, 2):
            rid = send(server)
            out[f"{name} #{turn}"] = (rid, "m", backend_usage(server, "m"))
    texts = {"model": "e", "input": ["one two three", "four"]}
    rid = whole(server, "/v1/embeddings", texts)  # the lane
    out["embeddings"] = (rid, "e", backend_usage(server, "e"))
    rid = whole(server, "/v1/embeddings", {**texts, "truncate": True})  # routed: not plain
    out["embeddings, routed"] = (rid, "e", backend_usage(server, "e"))
    return out


def activity_row(server: Server, request_id: str) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        rows = httpx.get(server.url + "/activity", headers=server.admin_headers,
                         timeout=10).json()["requests"]
        return next((r for r in rows if r["id"] == request_id), None)

    return poll(find, timeout_s=10, what=f"the activity row of {request_id}")


def test_each_requests_record_has_the_backends_usage(server: Server, answered: Any) -> None:
    assert any(u["cached_tokens"] for _, _, u in answered.values())  # the cache is seen too
    for name, (rid, model, usage) in answered.items():
        row = activity_row(server, rid)
        assert row["model"] == model and row["status"] == "200", name
        assert (row["prompt_tokens"], row["completion_tokens"], row["cached_tokens"]) == (
            usage["prompt_tokens"], usage["completion_tokens"], usage["cached_tokens"]), name


def _sums(answered: Any, model: str) -> tuple[int, int, int]:
    usages = [u for _, m, u in answered.values() if m == model]
    return (sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages),
            sum(u["cached_tokens"] for u in usages))


def test_metrics_and_the_usage_api_sum_the_backends_usage(server: Server,
                                                         answered: Any) -> None:
    text = httpx.get(server.url + "/metrics", headers=server.admin_headers, timeout=10).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def metric(name: str, **labels: str) -> int:
        return int(samples.get((name, tuple(sorted(labels.items()))), 0))

    usage = httpx.get(server.url + "/v1/usage", params={"group_by": "model"},
                      headers=server.admin_headers, timeout=10).json()["data"]
    rows = {row["model"]: row for row in usage}
    for model in ("m", "e"):
        prompt, completion, cached = _sums(answered, model)
        assert (metric("modelyard_tokens_total", model=model, direction="in"),
                metric("modelyard_tokens_total", model=model, direction="out")) == (
            prompt, completion), model
        owner = {"owner": "anonymous", "model": model}
        assert (metric("modelyard_usage_tokens_total", **owner, kind="prompt"),
                metric("modelyard_usage_tokens_total", **owner, kind="completion"),
                metric("modelyard_usage_tokens_total", **owner, kind="cached")) == (
            prompt, completion, cached), model
        row = rows[model]
        assert (row["prompt_tokens"], row["completion_tokens"], row["cached_tokens"]) == (
            prompt, completion, cached), model


# The figures that differ from one answer to the next: its id, its time, its speeds.
_VARYING = re.compile(rb'"(id|created|[a-z_]*_ms|[a-z_]*per_second)":("[^"]*"|[0-9.e+-]+)')


def _normal(stream: bytes) -> bytes:
    return _VARYING.sub(rb'"\1":0', stream)


def test_a_client_that_did_not_ask_gets_the_backends_stream_unchanged(
        server: Server, answered: Any) -> None:
    body = {**CHAT, "stream": True}
    _, through_front = stream(server, "/v1/chat/completions", body)
    sent = httpx.get(upstream(server, "m") + "/requests", timeout=10).json()[-1]
    assert sent["stream_options"] == {"include_usage": True}  # asked upstream for it
    [key_file] = [p for p in key_dir(server.home).iterdir() if p.name.startswith("m-")]
    # Straight from the backend, as the client asked (the same prompt: the same cache).
    with httpx.stream("POST", upstream(server, "m") + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key_file.read_text().strip()}"},
                      timeout=60) as r:
        direct = r.read()
    assert b'"usage"' not in through_front and b'"choices":[]' not in through_front
    assert b'"timings"' in through_front
    assert _normal(through_front) == _normal(direct)
    # The first and last figures are the same ones, not only the shape.
    assert through_front.count(b"data: ") == direct.count(b"data: ")


@pytest.mark.parametrize(("path", "plain", "routed", "status"), [
    ("/v1/chat/completions", CHAT, {**CHAT, "n": 1}, 200),
    ("/v1/embeddings", {"model": "e", "input": "one two"},
     {"model": "e", "input": "one two", "truncate": True}, 200),
    # Errors, in the same shape either way: a backend's context overflow (OpenAI's shape for
    # it), a model nobody has.
    ("/v1/chat/completions", LONG, {**LONG, "n": 1}, 400),
    ("/v1/chat/completions", {**CHAT, "model": "ghost"}, {**CHAT, "model": "ghost", "n": 1}, 404),
])
def test_the_lane_answers_as_the_route_does(server: Server, path: str, plain: dict[str, Any],
                                          routed: dict[str, Any], status: int) -> None:
    """A plain request answered on the lane (front/api/lane.py) and the same request made
    not plain by a field that changes nothing, answered by its route: the same status, headers
    and body (but for the figures that differ from one answer to the next)."""
    answers = [httpx.post(server.url + path, json=body, timeout=60) for body in (plain, routed)]
    assert [r.status_code for r in answers] == [status, status], [r.text for r in answers]
    [lane, route] = [(dict(r.headers), _normal(r.content)) for r in answers]
    for headers in (lane[0], route[0]):  # (the length: of figures that differ)
        del headers["x-request-id"], headers["date"], headers["content-length"]
    assert lane == route
