"""Anthropic Messages API: POST /v1/messages (JSON, or Anthropic's SSE events with `stream`)
and POST /v1/messages/count_tokens, so the official `anthropic` SDK works unchanged with
`base_url` set to the front (its `x-api-key` is read like a bearer token: front/identity/auth.py).

Validated here, translated to an OpenAI chat body (front/chat/anthropic_shapes.py) and run
through the one chat pipeline (front/chat/pipeline.py: sessions, archive, queues, leases, swap
progress), then framed by front/chat/render_anthropic.py. Errors on these paths are in
Anthropic's shape (front/render.py). With `stop_sequences`, a llama.cpp model is asked for its
`verbose` answer, the one that names the sequence it stopped on (`stop_sequence`).

count_tokens asks the model itself: the translated request, non-streamed and limited to one
token, goes to the backend through the dispatcher like any chat, and the answer's
`usage.prompt_tokens` (the templated prompt as the model's tokenizer counts it, tools included)
is the count. It loads the model if it is not loaded, as Anthropic's counts are the model's.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard.config import LlamaCppModel
from modelyard.errors import UpstreamError
from modelyard.front.api.context import chat_context, context_of
from modelyard.front.archive import capture as archive_capture
from modelyard.front.chat import pipeline
from modelyard.front.chat.anthropic_shapes import check_thinking, to_openai
from modelyard.front.chat.render_anthropic import AnthropicRender
from modelyard.front.chat.request import CHAT_PATH, ChatCall
from modelyard.front.chat.shapes import check_openai_chat
from modelyard.front.chat.tools.support import check_tools_for
from modelyard.front.chat.vision import check_vision_for
from modelyard.front.dispatch.relay import ClientWatch, watched
from modelyard.front.state import (
    FrontState,
    read_json_object,
    state_of,
    validate,
)


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class _Body(BaseModel):
    # Fields Anthropic has and modelyard does not use (metadata, service_tier, …) pass.
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = Field(
        None, description="`format` (a JSON schema) → response_format; `effort` ignored")
    thinking: dict[str, Any] | None = Field(
        None, description="validated as Anthropic does, not passed on (no thinking blocks)")


class MessagesRequest(_Body):
    max_tokens: int = Field(ge=1)
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = Field(None, description="accepted, ignored")


class CountTokensRequest(_Body):
    pass


def _openai_body(state: FrontState, data: dict[str, Any], req: _Body, *, max_tokens: int,
                 stream: bool) -> dict[str, Any]:  # fmt: skip
    check_thinking(req.thinking, getattr(req, "max_tokens", None))
    payload = to_openai(data, max_tokens=max_tokens, stream=stream)
    check_openai_chat(payload)  # the translated parts (an image's base64, a tool's schema)
    check_tools_for(state, req.model, payload)
    check_vision_for(state, req.model, payload)
    return payload


async def messages(request: Request) -> Response:
    state = state_of(request)
    data = await read_json_object(request)
    req = validate(MessagesRequest, data)
    payload = _openai_body(state, data, req, max_tokens=req.max_tokens, stream=req.stream)
    if req.stop_sequences and _on_llama_server(state, req.model):
        # llama-server names the stop sequence it stopped on only in its `__verbose` object:
        # asked for when there are stop sequences, so `stop_sequence` can be reported.
        payload["verbose"] = True
    call = ChatCall(
        "anthropic", "/v1/messages", req.model, CHAT_PATH, req.stream, payload,
        fields=data,  # `session_id` and `archive` are read from the client's own fields
        archive=data.get(archive_capture.BODY_FIELD),
    )
    return await pipeline.answer(chat_context(request, call), call, AnthropicRender())


def _on_llama_server(state: FrontState, model: str) -> bool:
    entry = state.catalog.registry.get(model)
    return entry is not None and isinstance(entry.spec, LlamaCppModel)


async def count_tokens(request: Request) -> Response:
    state = state_of(request)
    data = await read_json_object(request)
    req = validate(CountTokensRequest, data)
    payload = _openai_body(state, data, req, max_tokens=1, stream=False)
    ctx = context_of(request)
    watch = ClientWatch(ctx.receive, ctx.client_gone)  # a client that leaves stops the backend
    relay = await watched(watch, state.dispatch.open_relay(
        req.model, CHAT_PATH, orjson.dumps(payload), priority=ctx.priority))
    body = await relay.read()  # closes the relay (the lease goes back)
    if relay.status != 200:
        return AnthropicRender().upstream_error(
            ChatCall("anthropic", "/v1/messages/count_tokens", req.model, CHAT_PATH, False,
                     payload), relay.status, relay.content_type, body)
    try:
        tokens = orjson.loads(body)["usage"]["prompt_tokens"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        tokens = None
    if not isinstance(tokens, int):
        raise UpstreamError(f"the backend of '{req.model}' reported no prompt token count",
                            model=req.model)
    return Response(orjson.dumps({"input_tokens": tokens}), media_type="application/json")


routes = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
