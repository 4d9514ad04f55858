"""OpenAI API: /v1/chat/completions, /v1/completions (JSON or SSE), /v1/models.

The request is validated here, then its bytes go to the backend unchanged and the answer comes
back unchanged: the cheapest relay is the one that does not re-encode. (Only a request with
modelyard's own `archive` field is re-encoded, without it; see front/archive/capture.py; and a
chat in a server-side session, whose history is spliced in: front/chat/sessions/relay.py.) Parsed
here into the chat pipeline's request (front/chat/pipeline.py), which runs it.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard.errors import InvalidRequest
from modelyard.front.api.context import chat_context
from modelyard.front.archive import capture as archive_capture
from modelyard.front.chat import choices, legacy_functions, openai_compat, pipeline, render, scoring
from modelyard.front.chat.request import CHAT_PATH, COMPLETION_PATH, ChatCall
from modelyard.front.chat.shapes import check_openai_chat, check_roles
from modelyard.front.chat.tools.support import check_tools_for
from modelyard.front.chat.vision import check_vision_for
from modelyard.front.state import (
    FrontState,
    read_json_object,
    request_priority,
    state_of,
    validate,
)
from modelyard.store.registry import ModelRegistry


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    stream: bool = False
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1)  # its bound is the setting's: front/chat/choices.py


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: str | list[Any] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]


def openai_call(path: str, data: dict[str, Any], body: bytes, req: _Request, *,
                prepared: openai_compat.Prepared | None = None) -> ChatCall:
    """The pipeline's request for a validated OpenAI body: the client's bytes go upstream
    unchanged unless modelyard's `archive` field must come out first, or a feature llama-server
    serves differently (`prepared`: front/chat/openai_compat.py) rewrote them."""
    chat = path == CHAT_PATH
    upstream = path
    if prepared is not None:
        data, upstream = prepared.payload, prepared.path
        body = orjson.dumps(data)
    fields = None
    if archive_capture.BODY_FIELD in data:
        fields = data
        data = {k: v for k, v in data.items() if k != archive_capture.BODY_FIELD}
    return ChatCall(
        "openai", path, req.model, upstream, req.stream, data,
        body=body if fields is None else None, fields=fields,
        archive=None if fields is None else fields[archive_capture.BODY_FIELD], chat=chat,
        progress=chat,  # text completions have no place for reasoning: progress is for chats
        reshape=None if prepared is None else prepared.reshape,
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
    legacy = False
    if path == CHAT_PATH and (check_roles(data.get("messages")) or legacy_functions.used(data)):
        legacy = legacy_functions.answers_legacy(data)  # the legacy function calling
        data = legacy_functions.to_tools(data)
        body = orjson.dumps(data)
    n = _choices(state, req, data)
    if path == CHAT_PATH:
        check_openai_chat(data)  # a malformed part or tool: 400 naming it, not the backend's 500
        check_tools_for(state, req.model, data)
        check_vision_for(state, req.model, data)
    prepared = None
    if path == COMPLETION_PATH and scoring.concerns(data):  # echo + logprobs, or max_tokens 0
        if (scored := await scoring.answer(request.receive, request_priority(request), state,
                                           req.model, data)) is not None:
            return scored
        # else its backend scores the prompt itself: the request goes as sent
    else:
        # Parsed further only when it asks for what llama-server serves differently (§3.13).
        prepared = openai_compat.prepare(path, data, chat=path == CHAT_PATH, n=n,
                                          legacy=legacy)
    call = openai_call(path, data, body, req, prepared=prepared)
    return await pipeline.answer(chat_context(request, call), call, render.OPENAI)


def _choices(state: FrontState, req: _Request, data: dict[str, Any]) -> int:
    """The request's `n`, within `max_choices` (and a llama.cpp model's slots)."""
    if req.n is None or req.n == 1:
        return 1
    entry = state.catalog.registry.get(req.model)
    settings = state.catalog.settings
    n = choices.check_n(req.n, max_choices=settings.max_choices,
                        spec=None if entry is None else entry.spec,
                        slots=settings.llama_server_parallel)
    if n > 1 and any(isinstance(t, dict) and t.get("type") == "mcp"
                     for t in data.get("tools") or []):
        raise InvalidRequest("n: the MCP tool loop answers one choice; send n=1", param="n")
    return n


async def chat_completions(request: Request) -> Response:
    return await _relay(request, CHAT_PATH, ChatCompletionRequest)


async def completions(request: Request) -> Response:
    return await _relay(request, COMPLETION_PATH, CompletionRequest, cap_tokens=True)


# The fields llama-server reads as a generation limit.
LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")


def default_max_tokens(state: FrontState, model: str, data: dict[str, Any]) -> int | None:
    """The `max_tokens` a text completion gets when neither it nor its preset sets a limit:
    `default_max_tokens` (llama-server alone would generate until the context is full)."""
    cap = state.catalog.settings.default_max_tokens
    if cap is None or any(data.get(k) is not None for k in LIMIT_FIELDS):
        return None
    entry = state.catalog.registry.get(model)
    preset = None if entry is None else entry.preset
    if preset is not None and any(preset.parameters.get(k) is not None for k in LIMIT_FIELDS):
        return None
    return cap


def _model_list(registry: ModelRegistry, created: int) -> bytes:
    data: list[dict[str, Any]] = [
        {"id": name, "object": "model", "created": created, "owned_by": "modelyard"}
        for name, _ in registry.names()
    ]
    return orjson.dumps({"object": "list", "data": data})


async def list_models(request: Request) -> Response:
    state = state_of(request)
    created = int(state.started_at)
    # The same bytes until a reload or rescan replaces the registry (front/catalog.py).
    body = state.catalog.memo("openai:/v1/models", lambda r: _model_list(r, created))
    return Response(body, media_type="application/json")


async def retrieve_model(request: Request) -> Response:
    state = state_of(request)
    entry = state.catalog.registry.resolve(request.path_params["model"])
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
