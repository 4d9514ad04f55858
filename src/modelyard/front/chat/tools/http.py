"""The server-side tool loop (front/chat/tools/loop.py) as the OpenAI chat route answers it.

Streaming: each tool call shows as a chat chunk whose delta carries `reasoning_content` (`→
add({"a":2})` when it starts, `← 5` when it returns) and the structured `x_modelyard_tool_round`
({round, tool, arguments, result, is_error}), then the final answer's content, finish_reason and
`[DONE]`. Non-streaming: the final chat completion with `x_modelyard_tool_rounds` (the trace).
A client that leaves mid-loop cancels it (the tool call in progress included).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from starlette.responses import Response, StreamingResponse

from modelyard.errors import InvalidRequest, ModelyardError
from modelyard.front.archive import capture as archive_capture
from modelyard.front.chat.sessions.relay import begin_turn, commit_body, settled, tagged
from modelyard.front.chat.tools.loop import (
    Final,
    RoundEvent,
    ToolLoop,
    mcp_servers_of,
    unknown_servers,
)
from modelyard.front.chat.translate import now_rfc3339
from modelyard.front.dispatch.dispatcher import unless_disconnected
from modelyard.front.dispatch.relay import Relay
from modelyard.front.sse import sse_event
from modelyard.metrics import stream_failed

if TYPE_CHECKING:
    from modelyard.front.request_context import RequestContext

TRACE_FIELD = "x_modelyard_tool_rounds"
ROUND_FIELD = "x_modelyard_tool_round"


def tool_loop_for(ctx: RequestContext, data: dict[str, Any], model: str, *, api: str,
                  endpoint: str, stream: bool) -> ToolLoop | None:
    """The loop a chat request opts into, or None; unknown servers are refused. In a chat
    session (the context's), the loop runs on the stored history and stores the turn when it
    answers; archived when asked (the context's plan), its transcript is the whole exchange."""
    settings = ctx.state.catalog.settings
    servers = mcp_servers_of(data, settings)
    if servers is None:
        return None
    if unknown := unknown_servers(servers, settings):
        known = [s.id for s in settings.mcp_servers]
        raise InvalidRequest(
            f"tools: unknown MCP server(s) {unknown}; declared in mcp_servers: {known}",
            param="tools",
        )
    data = {k: v for k, v in data.items() if k != archive_capture.BODY_FIELD}
    loop = ToolLoop(ctx.state.chat.mcp, settings, data, servers)
    sid = ctx.session_id
    if sid is not None:
        turn = begin_turn(ctx, sid, model, data, kv_hints=False)
        loop.data = turn.body
        loop.turn = turn
        loop.on_answer.append(
            lambda messages, answer: commit_body(turn.with_messages(messages), answer))
    capture = archive_capture.chat_capture(
        ctx.archive, loop.data, api=api, endpoint=endpoint, model=model, stream=stream)
    if capture is not None:
        loop.capture = capture
        loop.on_answer.append(capture.save_exchange)
    return loop


def finished(loop: ToolLoop, response: Response) -> Response:
    """The loop's response naming its chat session and the archive item its transcript is
    saved as (when it answered, or streamed: see `streamed_body`)."""
    if loop.capture is not None and response.status_code == 200:
        response = loop.capture.attach(response)
    return tagged(response, loop.turn)


def streamed_body(loop: ToolLoop, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A streamed loop's body. In a chat session shared by several processes (workers, fronts),
    the chunks that follow the turn's commit wait until the database has it, as a plain turn's
    do (sessions/relay.py `settled`): the client's next turn, sent to another process as soon
    as this answer ends, continues it. Archived when asked: one that ends before the answer
    still saves the exchange so far (its response named the item)."""
    if loop.turn is not None:
        chunks = settled(loop.turn, chunks)
    if loop.capture is None:
        return chunks
    return loop.capture.tap_exchange(chunks, lambda: loop.messages)


def _opener(ctx: RequestContext, model: str, path: str) -> Callable[[bytes], Awaitable[Relay]]:
    def open_round(payload: bytes) -> Awaitable[Relay]:
        return ctx.state.dispatch.open_relay(
            model, path, payload, priority=ctx.priority, client=ctx.receive
        )

    return open_round


async def openai_chat(ctx: RequestContext, loop: ToolLoop, model: str, stream: bool) -> Response:
    open_round = _opener(ctx, model, "/v1/chat/completions")
    if stream:  # the first round runs before the headers: its errors get a real status
        items = await _primed(ctx, loop, open_round)
        if isinstance(items, Final):
            assert isinstance(items.body, bytes)
            return Response(items.body, status_code=items.status, media_type="application/json")
        return StreamingResponse(
            streamed_body(loop, _sse(items, model)), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    final = await unless_disconnected(ctx.receive, _whole(loop, open_round), lambda _: None)
    if isinstance(final.body, bytes):
        return Response(final.body, status_code=final.status, media_type="application/json")
    return Response(
        orjson.dumps({**final.body, TRACE_FIELD: final.trace}), media_type="application/json"
    )


async def _primed(ctx: RequestContext, loop: ToolLoop,
                  open_round: Callable[[bytes], Awaitable[Relay]]) -> Final | AsyncIterator[
                      RoundEvent | Final]:  # fmt: skip
    """The loop's items once the first is there (the upstream error, alone, if it is one)."""
    items = loop.run(open_round)

    async def head() -> RoundEvent | Final:
        return await anext(items)

    first = await unless_disconnected(ctx.receive, head(), lambda _: None)
    if isinstance(first, Final) and isinstance(first.body, bytes):
        return first

    async def chained() -> AsyncIterator[RoundEvent | Final]:
        try:
            yield first
            async for item in items:
                yield item
        finally:
            await items.aclose()

    return chained()


async def _whole(loop: ToolLoop, open_round: Callable[[bytes], Awaitable[Relay]]) -> Final:
    async for item in loop.run(open_round):
        if isinstance(item, Final):
            return item
    raise AssertionError("the tool loop ended without an answer")


def _chunk(model: str, delta: dict[str, Any], finish: str | None = None,
           extra: dict[str, Any] | None = None) -> bytes:  # fmt: skip
    return sse_event({
        "id": "chatcmpl-modelyard-tools", "object": "chat.completion.chunk",
        "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **(extra or {}),
    })  # fmt: skip


async def _sse(items: AsyncIterator[RoundEvent | Final], model: str) -> AsyncIterator[bytes]:
    try:
        async for item in items:
            if isinstance(item, RoundEvent):
                shown = {"role": "assistant", "content": None, "reasoning_content": item.text()}
                yield _chunk(model, shown, extra={ROUND_FIELD: item.to_json()})
                continue
            if isinstance(item.body, bytes):  # upstream refused a round: in-band, then close
                yield sse_event(_error_body(item))
                return
            choice = (item.body.get("choices") or [{}])[0]
            message = choice.get("message") or {}
            delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
            if message.get("tool_calls"):  # a client tool's call: the client runs it
                delta["tool_calls"] = [
                    {"index": i, **c} for i, c in enumerate(message["tool_calls"])
                ]
            yield _chunk(model, delta)
            usage = {"usage": item.body["usage"]} if "usage" in item.body else {}
            yield _chunk(model, {}, choice.get("finish_reason") or "stop",
                         extra={**usage, TRACE_FIELD: item.trace})  # fmt: skip
            yield b"data: [DONE]\n\n"
    except ModelyardError as exc:
        yield sse_event(stream_failed(exc).openai_body())


def _error_body(final: Final) -> Any:
    assert isinstance(final.body, bytes)
    try:
        return orjson.loads(final.body)
    except orjson.JSONDecodeError:
        return {"error": {"message": final.body.decode(errors="replace")[:500],
                          "type": "upstream_error", "code": str(final.status)}}  # fmt: skip


# --- Ollama /api/chat ---------------------------------------------------------------------------


async def ollama_chat(ctx: RequestContext, loop: ToolLoop, model: str, stream: bool) -> Response:
    """The same loop answered in Ollama's shapes: NDJSON chunks whose `message.thinking` shows
    each round (plus `x_modelyard_tool_round`), then the answer; or one JSON object."""
    open_round = _opener(ctx, model, "/v1/chat/completions")
    if stream:  # the first round runs before the headers: its errors get a real status
        items = await _primed(ctx, loop, open_round)
        if isinstance(items, Final):
            return Response(orjson.dumps({"error": _error_text(items)}), status_code=items.status,
                            media_type="application/json")  # fmt: skip
        return StreamingResponse(streamed_body(loop, _ndjson_rounds(items, model)),
                                 media_type="application/x-ndjson")  # fmt: skip
    final = await unless_disconnected(ctx.receive, _whole(loop, open_round), lambda _: None)
    if isinstance(final.body, bytes):
        return Response(orjson.dumps({"error": _error_text(final)}), status_code=final.status,
                        media_type="application/json")  # fmt: skip
    return Response(orjson.dumps(_ollama_final(model, final, with_content=True)),
                    media_type="application/json")  # fmt: skip


def _ollama_message(model: str, message: dict[str, Any], done: bool) -> dict[str, Any]:
    return {"model": model, "created_at": now_rfc3339(), "message": message, "done": done}


def _ollama_final(model: str, final: Final, *, with_content: bool) -> dict[str, Any]:
    assert isinstance(final.body, dict)
    choice = (final.body.get("choices") or [{}])[0]
    upstream = choice.get("message") or {}
    message: dict[str, Any] = {"role": "assistant",
                               "content": (upstream.get("content") or "") if with_content else ""}
    if upstream.get("tool_calls") and with_content:
        message["tool_calls"] = [_ollama_call(c) for c in upstream["tool_calls"]]
    out = _ollama_message(model, message, True)
    reason = choice.get("finish_reason") or "stop"
    out["done_reason"] = "length" if reason == "length" else "stop"
    usage = final.body.get("usage") or {}
    out["prompt_eval_count"] = usage.get("prompt_tokens", 0)
    out["eval_count"] = usage.get("completion_tokens", 0)
    out[TRACE_FIELD] = final.trace
    return out


def _ollama_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    try:
        arguments = orjson.loads(fn.get("arguments") or "{}")
    except orjson.JSONDecodeError:
        arguments = {}
    return {"function": {"name": fn.get("name", ""), "arguments": arguments}}


async def _ndjson_rounds(items: AsyncIterator[RoundEvent | Final],
                         model: str) -> AsyncIterator[bytes]:  # fmt: skip
    try:
        async for item in items:
            if isinstance(item, RoundEvent):
                shown = {"role": "assistant", "content": "", "thinking": item.text()}
                chunk = {**_ollama_message(model, shown, False), ROUND_FIELD: item.to_json()}
                yield orjson.dumps(chunk) + b"\n"
                continue
            if isinstance(item.body, bytes):
                yield orjson.dumps({"error": _error_text(item)}) + b"\n"
                return
            whole = _ollama_final(model, item, with_content=True)
            yield orjson.dumps(_ollama_message(model, whole["message"], False)) + b"\n"
            yield orjson.dumps(_ollama_final(model, item, with_content=False)) + b"\n"
    except ModelyardError as exc:
        yield orjson.dumps({"error": stream_failed(exc).message}) + b"\n"


def _error_text(final: Final) -> str:
    body = _error_body(final)
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err if err is not None else body)
