"""Ollama API: /api/chat, /api/generate (NDJSON streaming by default); the model listing
(/api/tags, /api/ps, /api/show, /api/version) is front/api/ollama_models.py.

Requests are translated to the OpenAI calls llama-server serves (here, into the chat pipeline's
request: front/chat/pipeline.py runs it) and answers back into Ollama's shapes
(front/chat/render.py), with its statistics (durations in nanoseconds) filled from llama-server's
timings.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard.errors import InvalidRequest
from modelyard.front.api.context import chat_context
from modelyard.front.archive import capture as archive_capture
from modelyard.front.chat import context, ollama_context, ollama_fit, pipeline, render
from modelyard.front.chat.go_template import render_prompt
from modelyard.front.chat.infill import INFILL_PATH, check_insert_for, infill_payload
from modelyard.front.chat.request import CHAT_PATH, COMPLETION_PATH, ChatCall
from modelyard.front.chat.shapes import check_ollama_chat, check_ollama_images
from modelyard.front.chat.thinking import check_think, check_thinking_for, thinking_fields
from modelyard.front.chat.tools.support import check_tools_for
from modelyard.front.chat.translate import now_rfc3339, ollama_messages_to_openai
from modelyard.front.chat.vision import check_vision_for
from modelyard.front.request_context import RequestContext
from modelyard.front.state import (
    FrontState,
    read_json_object,
    state_of,
    validate,
)

# Ollama option → OpenAI/llama-server request field.
_OPTION_MAP = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "num_predict": "max_tokens",
    "repeat_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "typical_p": "typical_p",
}


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None


class _OllamaRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    stream: bool = True
    options: dict[str, Any] = Field(default_factory=dict)
    format: str | dict[str, Any] | None = None
    keep_alive: str | int | float | None = None
    think: bool | str | None = None  # true/false or a level: front/chat/thinking.py


class ChatRequest(_OllamaRequest):
    messages: list[OllamaMessage] = Field(default_factory=list)


class GenerateRequest(_OllamaRequest):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None
    template: str | None = None  # a Go-template prompt override: front/chat/go_template.py
    suffix: str | None = None  # fill in the middle: front/chat/infill.py
    # Token ids of an earlier exchange, read before this prompt: front/chat/ollama_context.py.
    context: list[StrictInt] | None = None

    @property
    def verbatim(self) -> bool:
        """The prompt goes to the completion endpoint as it is (`raw`) or as `template` makes
        it, or with a `suffix` to fill in: the model's chat template is not applied."""
        return self.raw or bool(self.template) or bool(self.suffix)


def _content(text: str, images: list[str] | None) -> str | list[dict[str, Any]]:
    if not images:
        return text
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{img}"}}
        for img in images
    ]
    return parts


def _openai_params(req: _OllamaRequest) -> dict[str, Any]:
    params: dict[str, Any] = {"model": req.model, "stream": req.stream}
    if req.stream:
        params["stream_options"] = {"include_usage": True}
    for name, value in req.options.items():
        target = _OPTION_MAP.get(name)
        if target is not None and value is not None:
            params[target] = value
    tools = (req.model_extra or {}).get("tools")
    if tools:
        params["tools"] = tools
    if req.format == "json":
        params["response_format"] = {"type": "json_object"}
    elif isinstance(req.format, dict):
        params["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "response", "schema": req.format},
        }
    elif req.format not in (None, ""):
        raise InvalidRequest("`format` must be \"json\" or a JSON schema", param="format")
    if not (isinstance(req, GenerateRequest) and req.verbatim):  # no chat template to switch
        params.update(thinking_fields(check_think(req.think)))
    return params


def chat_payload(req: ChatRequest) -> dict[str, Any]:
    params = _openai_params(req)
    params["messages"] = ollama_messages_to_openai([
        {**m.model_dump(exclude={"images"}, exclude_none=True),
         "content": _content(m.content, m.images)}
        for m in req.messages
    ])
    return params


def generate_payload(req: GenerateRequest) -> tuple[str, dict[str, Any]]:
    params = _openai_params(req)
    if req.suffix:
        return INFILL_PATH, infill_payload(params, req.prompt, req.suffix)
    if req.template:
        params["prompt"] = render_prompt(req.template, system=req.system or "", prompt=req.prompt)
        return COMPLETION_PATH, params
    if req.raw:
        params["prompt"] = req.prompt
        return COMPLETION_PATH, params
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": req.system})
    messages.append({"role": "user", "content": _content(req.prompt, req.images)})
    params["messages"] = messages
    return CHAT_PATH, params


def chat_call(req: ChatRequest, *, keep_alive_s: float | None,
              endpoint: str = "/api/chat") -> ChatCall:
    """The chat pipeline's request for a validated /api/chat body (with messages)."""
    fields = req.model_extra or {}
    return ChatCall(
        "ollama", endpoint, req.model, CHAT_PATH, req.stream, chat_payload(req), fields=fields,
        archive=fields.get(archive_capture.BODY_FIELD), keep_alive_s=keep_alive_s,
        fit=ollama_fit.drop_turns,  # a long chat loses its oldest turns
    )


def generate_call(req: GenerateRequest, *, keep_alive_s: float | None,
                  endpoint: str = "/api/generate") -> ChatCall:
    """The chat pipeline's request for a validated /api/generate body (with a prompt): no
    session (`chat` False), swap progress as `thinking`."""
    fields = req.model_extra or {}
    path, params = generate_payload(req)
    return ChatCall(
        "ollama", endpoint, req.model, path, req.stream, params, fields=fields,
        archive=fields.get(archive_capture.BODY_FIELD), keep_alive_s=keep_alive_s, chat=False,
        fit=None if req.suffix else ollama_fit.keep_end,  # a long prompt keeps its end
    )


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: str | int | float | None) -> float | None:
    """Ollama's `keep_alive`: seconds as a number, or a Go duration ("5m", "1h30m", "0");
    negative keeps the model loaded forever (returned as -1). None: the configured default."""
    if value is None:
        return None
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise InvalidRequest(f"keep_alive: {value!r} is not a duration", param="keep_alive")
        return -1.0 if value < 0 else float(value)
    text = value.strip()
    try:
        return keep_alive_seconds(float(text))
    except ValueError:
        pass
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text)
    parts = _DURATION.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        raise InvalidRequest(
            f"keep_alive: {value!r} is not a duration (e.g. 300, \"5m\", \"1h\", -1)",
            param="keep_alive",
        )
    seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
    return -1.0 if sign < 0 else seconds


async def _load_or_unload(
    state: FrontState, req: _OllamaRequest, keep_alive_s: float | None, body: dict[str, Any]
) -> Response:
    """Ollama loads a model for a request with nothing to generate, and unloads it when that
    request says `keep_alive: 0`."""
    entry = state.catalog.registry.resolve(req.model)
    engine = await state.dispatch.route(entry)
    if keep_alive_s == 0:
        await engine.unload(entry.id)
        reason = "unload"
    else:
        await engine.load(entry.id, keep_alive_s)
        reason = "load"
    out = {"model": req.model, "created_at": now_rfc3339(), **body, "done": True,
           "done_reason": reason}
    return Response(orjson.dumps(out), media_type="application/json")


async def chat(request: Request) -> Response:
    state = state_of(request)
    data = await read_json_object(request)
    req = validate(ChatRequest, data)
    check_ollama_chat(data)  # a malformed image or tool: 400 naming it, not the backend's 500
    keep_alive_s = keep_alive_seconds(req.keep_alive)
    if not req.messages:
        empty = {"message": {"role": "assistant", "content": ""}}
        return await _load_or_unload(state, req, keep_alive_s, empty)
    call = chat_call(req, keep_alive_s=keep_alive_s, endpoint=request.url.path)
    ctx = chat_context(request, call)
    check_tools_for(state, req.model, call.payload)
    check_vision_for(state, req.model, call.payload)
    check_thinking_for(state, req.model, req.think)
    call.serve_as = await _serve_as(request, ctx, req.model, req.options.get("num_ctx"))
    return await pipeline.answer(ctx, call, render.OLLAMA_CHAT)


async def _serve_as(request: Request, ctx: RequestContext, model: str,
                    num_ctx: Any) -> str | None:  # fmt: skip
    """The context variant `num_ctx` asks for (front/chat/context.py), within the caller's
    `max_num_ctx` limit (looked up only when it asks); admins have none."""
    principal = ctx.principal
    limiter = None if num_ctx is None else getattr(request.app.state, "limits", None)
    allowed = None if principal.can("admin") or limiter is None else (
        limiter.max_num_ctx(principal))
    return await context.serve_as(ctx.state, model, num_ctx, allowed=allowed)


async def generate(request: Request) -> Response:
    state = state_of(request)
    data = await read_json_object(request)
    req = validate(GenerateRequest, data)
    check_ollama_images(data.get("images"), "images")  # 400 naming it, not the backend's 500
    keep_alive_s = keep_alive_seconds(req.keep_alive)
    if not req.prompt and not req.images:
        return await _load_or_unload(state, req, keep_alive_s, {"response": ""})
    call = generate_call(req, keep_alive_s=keep_alive_s, endpoint=request.url.path)
    ctx = chat_context(request, call)  # a `session_id` is a 400 here: sessions are for /api/chat
    check_vision_for(state, req.model, call.payload)
    if not req.verbatim:
        check_thinking_for(state, req.model, req.think)
    if req.suffix:
        check_insert_for(state, req.model)
    call.serve_as = await _serve_as(request, ctx, req.model, req.options.get("num_ctx"))
    await _with_context(ctx, req, call)
    return await pipeline.answer(ctx, call, render.OLLAMA_GENERATE)


async def _with_context(ctx: RequestContext, req: GenerateRequest, call: ChatCall) -> None:
    """Ollama's `context` (front/chat/ollama_context.py): returned, and followed when sent,
    where the model and the request allow; a `context` sent where they do not is a 400."""
    sent = ollama_context.check_context(req.context)
    if req.raw:  # as Ollama: a raw prompt has no context, and one sent is ignored
        return
    why = ollama_context.why_not(ctx.state, req.model, raw=req.raw, suffix=bool(req.suffix),
                                 images=bool(req.images))
    if why is not None:
        if sent:
            raise InvalidRequest(f"`context` is not supported for {why}", param="context",
                                 model=req.model)
        return
    prompt_text = call.payload["prompt"] if req.template else None
    await ollama_context.prepare(ctx, call, context=sent, prompt_text=prompt_text)


routes = [
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/generate", generate, methods=["POST"]),
]
