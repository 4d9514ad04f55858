"""Ollama API: /api/chat, /api/generate (NDJSON streaming by default), /api/tags, /api/ps,
/api/show, /api/version.

Requests are translated to the OpenAI calls llama-server serves and answers back into Ollama's
shapes, with its statistics (durations in nanoseconds) filled from llama-server's timings.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard import __version__
from modelyard.errors import InvalidRequest
from modelyard.front.proxy import LeasedStream, translated_stream
from modelyard.front.state import FrontState, read_json_object, state_of, upstream_message, validate
from modelyard.front.translate import Generation, now_rfc3339
from modelyard.store.gguf import GgufError, GgufInfo, read_gguf_info
from modelyard.store.registry import Entry

# Clients gate features on the Ollama version they talk to; we speak this one's API.
OLLAMA_COMPAT_VERSION = "0.12.6"

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


class ChatRequest(_OllamaRequest):
    messages: list[OllamaMessage] = Field(default_factory=list)


class GenerateRequest(_OllamaRequest):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None


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
    return params


def chat_payload(req: ChatRequest) -> dict[str, Any]:
    params = _openai_params(req)
    params["messages"] = [
        {**m.model_dump(exclude={"images"}, exclude_none=True),
         "content": _content(m.content, m.images)}
        for m in req.messages
    ]
    return params


def generate_payload(req: GenerateRequest) -> tuple[str, dict[str, Any]]:
    params = _openai_params(req)
    if req.raw:
        params["prompt"] = req.prompt
        return "/v1/completions", params
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": req.system})
    messages.append({"role": "user", "content": _content(req.prompt, req.images)})
    params["messages"] = messages
    return "/v1/chat/completions", params


def _ndjson(payload: dict[str, Any]) -> bytes:
    return orjson.dumps(payload) + b"\n"


async def _answer(
    state: FrontState,
    req: _OllamaRequest,
    path: str,
    params: dict[str, Any],
    shape: Any,
) -> Response:
    """Run the call upstream; `shape(gen, text, done)` builds each Ollama message."""
    gen = Generation.start()
    relay = await state.open_relay(req.model, path, orjson.dumps(params))
    gen.load_duration_ns = relay.lease.load_duration_ns
    if relay.status != 200 or not req.stream:
        body = await relay.read()
        if relay.status != 200:
            return Response(
                orjson.dumps({"error": upstream_message(body)}),
                status_code=relay.status,
                media_type="application/json",
            )
        gen.absorb(orjson.loads(body))
        return Response(orjson.dumps(shape(gen, gen.content, True)), media_type="application/json")
    stream = translated_stream(
        relay,
        gen.absorb,
        on_text=lambda text: _ndjson(shape(gen, text, False)),
        on_done=lambda: _ndjson(shape(gen, "", True)),
        on_error=lambda exc: _ndjson(exc.ollama_body()),
    )
    return LeasedStream(stream, relay, "application/x-ndjson")


def _chat_shape(model: str) -> Any:
    def shape(gen: Generation, text: str, done: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": model,
            "created_at": now_rfc3339(),
            "message": {"role": "assistant", "content": text},
            "done": done,
        }
        if done:
            out["done_reason"] = gen.done_reason
            out.update(gen.stats())
        return out

    return shape


def _generate_shape(model: str) -> Any:
    def shape(gen: Generation, text: str, done: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": model,
            "created_at": now_rfc3339(),
            "response": text,
            "done": done,
        }
        if done:
            out["done_reason"] = gen.done_reason
            out.update(gen.stats())
        return out

    return shape


async def chat(request: Request) -> Response:
    state = state_of(request)
    req = validate(ChatRequest, await read_json_object(request))
    if not req.messages:
        # Ollama answers an empty chat by loading the model and returning an empty message.
        state.registry.resolve(req.model)
        return Response(
            orjson.dumps(
                {"model": req.model, "created_at": now_rfc3339(),
                 "message": {"role": "assistant", "content": ""}, "done": True,
                 "done_reason": "load"}
            ),
            media_type="application/json",
        )
    return await _answer(
        state, req, "/v1/chat/completions", chat_payload(req), _chat_shape(req.model)
    )


async def generate(request: Request) -> Response:
    state = state_of(request)
    req = validate(GenerateRequest, await read_json_object(request))
    path, params = generate_payload(req)
    return await _answer(state, req, path, params, _generate_shape(req.model))


def _digest(entry: Entry) -> str:
    """A stable identity for the file (path, size, mtime), not a hash of its bytes."""
    st = entry.path.stat() if entry.path is not None and entry.path.exists() else None
    key = f"{entry.path}:{st.st_size if st else 0}:{st.st_mtime_ns if st else 0}"
    return hashlib.sha256(key.encode()).hexdigest()


def _gguf(entry: Entry) -> GgufInfo | None:
    if entry.format != "gguf" or entry.path is None:
        return None
    try:
        return read_gguf_info(entry.path)
    except (GgufError, OSError):
        return None


def _parameter_size(count: int | None) -> str:
    if not count:
        return ""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}".replace(".0", "")
    return str(count)


def _details(entry: Entry, info: GgufInfo | None) -> dict[str, Any]:
    family = info.architecture if info else ""
    return {
        "parent_model": "",
        "format": entry.format,
        "family": family,
        "families": [family] if family else None,
        "parameter_size": _parameter_size(info.parameter_count if info else None),
        "quantization_level": (info.file_type or "") if info else "",
    }


def _tag(entry: Entry, info: GgufInfo | None) -> dict[str, Any]:
    mtime = entry.path.stat().st_mtime if entry.path and entry.path.exists() else 0
    from datetime import UTC, datetime

    return {
        "name": entry.id,
        "model": entry.id,
        "modified_at": datetime.fromtimestamp(mtime, UTC).isoformat().replace("+00:00", "Z"),
        "size": entry.size_bytes or 0,
        "digest": _digest(entry),
        "details": _details(entry, info),
    }


async def tags(request: Request) -> Response:
    state = state_of(request)
    models = [_tag(e, _gguf(e)) for e in state.registry.entries()]
    return Response(orjson.dumps({"models": models}), media_type="application/json")


async def ps(request: Request) -> Response:
    state = state_of(request)
    running = []
    for m in (await state.engine_models()).values():
        entry = state.registry.get(m["model"])
        if m["state"] != "ready" or entry is None:
            continue
        tag = _tag(entry, _gguf(entry))
        tag.pop("modified_at")
        tag.update({"expires_at": "0001-01-01T00:00:00Z", "size_vram": 0, "engine": m["engine"]})
        running.append(tag)
    return Response(orjson.dumps({"models": running}), media_type="application/json")


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    name: str | None = None  # older clients send `name`


async def show(request: Request) -> Response:
    state = state_of(request)
    req = validate(ShowRequest, await read_json_object(request))
    name = req.model or req.name
    if not name:
        raise InvalidRequest("`model` is required", param="model")
    entry = state.registry.resolve(name)
    info = _gguf(entry)
    body: dict[str, Any] = {
        "modelfile": f"FROM {entry.path}\n" if entry.path else "",
        "parameters": "",
        "template": (info.chat_template or "") if info else "",
        "details": _details(entry, info),
        "model_info": info.metadata if info else {},
        "capabilities": ["completion"],
        "modified_at": _tag(entry, info)["modified_at"],
    }
    return Response(orjson.dumps(body), media_type="application/json")


async def version(_: Request) -> Response:
    return Response(
        orjson.dumps({"version": OLLAMA_COMPAT_VERSION, "modelyard": __version__}),
        media_type="application/json",
    )


routes = [
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/generate", generate, methods=["POST"]),
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/version", version, methods=["GET"]),
]
