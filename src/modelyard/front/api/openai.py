"""OpenAI API: /v1/chat/completions, /v1/completions (JSON or SSE), /v1/models.

The request is validated here, then its bytes go to the backend unchanged and the answer comes
back unchanged: the cheapest relay is the one that does not re-encode. (Only a request with
modelyard's own `archive` field is re-encoded, without it; see front/archive_capture.py; and a
chat in a server-side session, whose history is spliced in: front/session_relay.py.)
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard.errors import ModelyardError
from modelyard.front import archive_capture, tool_loop_http
from modelyard.front.chat_shapes import check_openai_chat
from modelyard.front.proxy import (
    ClientWatch,
    LeasedStream,
    Relay,
    passthrough_error,
    relay_raw,
    watched,
)
from modelyard.front.session_relay import begin_turn, commit_body, session_id_for, tagged, tap_sse
from modelyard.front.sse import sse_event
from modelyard.front.state import (
    FrontState,
    read_json_object,
    request_priority,
    state_of,
    validate,
)
from modelyard.front.swap_progress import open_for_stream
from modelyard.front.tool_loop_http import tool_loop_for
from modelyard.front.tool_support import check_tools_for
from modelyard.front.vision_support import check_vision_for


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    stream: bool = False
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, le=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: str | list[Any] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]


def openai_error_event(exc: ModelyardError) -> bytes:
    return sse_event(exc.openai_body())


def swap_progress_chunk(model: str, text: str) -> bytes:
    """A chat chunk carrying swap progress as reasoning, before the first token."""
    delta = {"role": "assistant", "content": None, "reasoning_content": text + "\n"}
    return sse_event(
        {"id": "chatcmpl-modelyard-swap", "object": "chat.completion.chunk",
         "created": int(time.time()), "model": model,
         "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    )


async def _relay(
    request: Request, path: str, schema: type[_Request], *, cap_tokens: bool = False
) -> Response:
    state = state_of(request)
    body = await request.body()
    data = await read_json_object(request)
    req = validate(schema, data)
    if cap_tokens and (cap := default_max_tokens(state, req.model, data)) is not None:
        data = {**data, "max_tokens": cap}
        body = orjson.dumps(data)
    if "chat" in path:
        check_openai_chat(data)  # a malformed part or tool: 400 naming it, not the backend's 500
        check_tools_for(state, req.model, data)
        check_vision_for(state, req.model, data)
    # The server-side tool loop over MCP servers (front/tool_loop.py), when the chat opts in.
    if "chat" in path and (loop := tool_loop_for(request, data, req.model, api="openai",
                                                 stream=req.stream)) is not None:
        answered = await tool_loop_http.openai_chat(request, loop, req.model, req.stream)
        return tool_loop_http.finished(loop, answered)
    # A server-side session (front/sessions.py): its history is spliced in, the body re-encoded.
    sid = session_id_for(request, data, chat="chat" in path)
    turn = None if sid is None else begin_turn(request, sid, req.model, data)
    if turn is not None:
        data = turn.body
    # Archived only when asked (header or `archive` field); the backend never sees the field.
    capture = archive_capture.chat_capture(
        request, data, asked=data.get(archive_capture.BODY_FIELD), api="openai", endpoint=path,
        model=req.model, stream=req.stream)
    if archive_capture.BODY_FIELD in data or turn is not None:
        body = orjson.dumps({k: v for k, v in data.items() if k != archive_capture.BODY_FIELD})

    # A non-streamed answer is awaited watching the client: one that leaves stops it.
    watch = None if req.stream else ClientWatch(request.receive)

    def open_relay(say: Callable[[str], None] | None) -> Awaitable[Relay]:
        return state.open_relay(
            req.model, path, body, priority=request_priority(request),
            client=None if watch else request, on_progress=say,
            session_kv=None if turn is None else turn.kv,
        )

    def stream_body(relay: Relay) -> AsyncIterator[bytes]:
        chunks = relay_raw(relay, openai_error_event)
        if turn is not None:
            chunks = tap_sse(turn, chunks)
        return chunks if capture is None else capture.tap_sse(chunks)

    opened = await watched(watch, open_for_stream(
        open_relay,
        # Text completions have no place for reasoning: progress is for chats only.
        enabled=req.stream and state.settings.notify_model_swap and "chat" in path,
        render_progress=lambda text: swap_progress_chunk(req.model, text),
        render_error=openai_error_event,
        body=stream_body,
        media_type="text/event-stream",
    ))
    if not isinstance(opened, Relay):
        return tagged(opened if capture is None else capture.attach(opened), turn)
    relay = opened
    if relay.status != 200:
        return tagged(passthrough_error(relay, await relay.read()), turn)
    if not req.stream:
        answer = await relay.read()
        if turn is not None:
            commit_body(turn, answer)
        if capture is not None:
            capture.save_response(answer)
        whole = Response(answer, media_type="application/json")
        return tagged(whole if capture is None else capture.attach(whole), turn)
    response = LeasedStream(stream_body(relay), relay, "text/event-stream")
    return tagged(response if capture is None else capture.attach(response), turn)


async def chat_completions(request: Request) -> Response:
    return await _relay(request, "/v1/chat/completions", ChatCompletionRequest)


async def completions(request: Request) -> Response:
    return await _relay(request, "/v1/completions", CompletionRequest, cap_tokens=True)


# The fields llama-server reads as a generation limit.
LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")


def default_max_tokens(state: FrontState, model: str, data: dict[str, Any]) -> int | None:
    """The `max_tokens` a text completion gets when neither it nor its preset sets a limit:
    `default_max_tokens` (llama-server alone would generate until the context is full)."""
    cap = state.settings.default_max_tokens
    if cap is None or any(data.get(k) is not None for k in LIMIT_FIELDS):
        return None
    entry = state.registry.get(model)
    preset = None if entry is None else entry.preset
    if preset is not None and any(preset.parameters.get(k) is not None for k in LIMIT_FIELDS):
        return None
    return cap


async def list_models(request: Request) -> Response:
    state = state_of(request)
    created = int(state.started_at)
    data: list[dict[str, Any]] = [
        {"id": name, "object": "model", "created": created, "owned_by": "modelyard"}
        for name, _ in state.registry.names()
    ]
    return Response(
        orjson.dumps({"object": "list", "data": data}), media_type="application/json"
    )


async def retrieve_model(request: Request) -> Response:
    state = state_of(request)
    entry = state.registry.resolve(request.path_params["model"])
    return Response(
        orjson.dumps(
            {"id": entry.name, "object": "model", "created": int(time.time()),
             "owned_by": "modelyard"}
        ),
        media_type="application/json",
    )


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
]
