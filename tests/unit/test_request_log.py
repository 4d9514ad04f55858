"""The request log: each inference request the metrics middleware sees ends as one
RequestRecord handed to every sink, with what the hooks noted (model, queue wait, swap, tokens
with the cached ones, owner); a sink that raises costs neither the request nor the others."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient
from starlette.types import Receive, Scope, Send

from modelyard import metrics
from modelyard.front.identity.principal import Principal
from modelyard.front.ops.metrics import RequestMetrics
from modelyard.front.ops.request_log import RequestLog, RequestRecord

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

ANSWER = (b'{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5,'
          b'"prompt_tokens_details":{"cached_tokens":8}}}')


async def _handler(request: Request) -> Response:
    metrics.note_model("m1")
    metrics.note_queue_wait(0.25)
    metrics.note_swap()
    metrics.note_opened()
    metrics.note_usage(metrics.usage_in_body(ANSWER))  # the relay's usage event
    return Response(ANSWER, media_type="application/json")


def _app(log: RequestLog) -> TestClient:
    inner = Starlette(routes=[Route("/v1/chat/completions", _handler, methods=["POST"])])
    inner.state.front = SimpleNamespace(ops=SimpleNamespace(requests=log))
    principal = Principal("alice", False, frozenset({"inference"}), "token", token_id="t1")

    async def with_principal(scope: Scope, receive: Receive, send: Send) -> None:
        scope["modelyard.principal"] = principal  # what the auth gate attaches
        await inner(scope, receive, send)

    metered = RequestMetrics(with_principal)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = inner  # Starlette sets it for the whole stack
        await metered(scope, receive, send)

    return TestClient(app)


def test_a_request_ends_as_one_record_with_what_the_hooks_noted() -> None:
    log = RequestLog()
    seen: list[RequestRecord] = []

    def broken(record: RequestRecord) -> None:
        raise RuntimeError("a sink's bug")

    log.add_sink(broken)
    log.add_sink(seen.append)
    response = _app(log).post("/v1/chat/completions", json={})
    assert response.status_code == 200
    assert len(seen) == 1
    record = seen[0]
    assert (record.user, record.token_id, record.api, record.model) == (
        "alice", "t1", "openai", "m1")
    assert (record.prompt_tokens, record.cached_tokens, record.completion_tokens) == (12, 8, 5)
    assert record.status == "200" and record.ok
    assert record.queue_wait_s == pytest.approx(0.25)
    assert record.swapped
    assert record.duration_s >= 0 and record.started_at > 0
    # a whole JSON answer: its first token came with its last
    assert record.ttft_s is not None and 0 <= record.ttft_s <= record.duration_s
    assert not record.streamed
    # tokens per second of a whole answer: over the request, not over the gap after its
    # only body chunk (that gave hundreds of thousands)
    assert record.tokens_per_s == pytest.approx(5 / record.duration_s)


def test_tokens_per_second_of_a_stream_count_from_its_first_token() -> None:
    base = dict(request_id=None, started_at=1.0, user=None, token_id=None, api="openai",
                path="/v1/chat/completions", model="m", status="200", prompt_tokens=3,
                cached_tokens=0, completion_tokens=10, ttft_s=1.0, duration_s=3.0,
                queue_wait_s=0.0, swapped=False)
    assert RequestRecord(**base, streamed=True).tokens_per_s == pytest.approx(5.0)
    assert RequestRecord(**base, streamed=False).tokens_per_s == pytest.approx(10 / 3)


def test_no_sink_no_record() -> None:
    log = RequestLog()
    assert not log.active
    assert _app(log).post("/v1/chat/completions", json={}).status_code == 200
