"""modelyard's native API: /chat, /models, /health, /status, /diag.

`/chat` answers with Ollama-style statistics (nanoseconds); `stream: true` gives SSE chunks
`{"delta": {"content": …}, "done": false}` and a final `{"delta": {}, "done": true, …stats}`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import psutil
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard import __version__
from modelyard.errors import ModelyardError
from modelyard.front import archive_capture
from modelyard.front.chat_shapes import check_openai_chat
from modelyard.front.jobs import ACTIVE
from modelyard.front.overview import overview
from modelyard.front.principal import principal_of
from modelyard.front.proxy import ClientWatch, LeasedStream, Relay, translated_stream, watched
from modelyard.front.redact import client_diag, client_models, client_overview, client_status
from modelyard.front.session_relay import (
    begin_turn,
    commit_body,
    session_id_for,
    tagged,
    tap_translated,
)
from modelyard.front.sse import sse_event
from modelyard.front.state import (
    read_json_object,
    request_priority,
    state_of,
    upstream_message,
    validate,
)
from modelyard.front.swap_progress import open_for_stream
from modelyard.front.tool_support import check_tools_for
from modelyard.front.translate import Generation, now_rfc3339
from modelyard.front.vision_support import check_vision_for


class NativeMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: str | list[Any] = ""


class NativeChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[NativeMessage] = Field(min_length=1)
    stream: bool = False
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def _final(model: str, gen: Generation, *, with_message: bool = True) -> dict[str, Any]:
    final: dict[str, Any] = {"model": model, "created_at": now_rfc3339()}
    if with_message:
        final["message"] = {"role": "assistant", "content": gen.content}
    if gen.tool_calls:  # the complete calls, OpenAI's shape (arguments as JSON text)
        final["tool_calls"] = gen.openai_tool_calls()
    return {**final, "done": True, "done_reason": gen.done_reason, **gen.stats()}


async def chat(request: Request) -> Response:
    state = state_of(request)
    req = validate(NativeChatRequest, await read_json_object(request))
    params = req.model_dump(exclude_none=True)
    check_openai_chat(params)  # a malformed part or tool: 400 naming it, not the backend's 500
    check_tools_for(state, req.model, params)
    check_vision_for(state, req.model, params)
    # A server-side session (front/sessions.py): its history is spliced in.
    sid = session_id_for(request, params)
    turn = None if sid is None else begin_turn(request, sid, req.model, params)
    if turn is not None:
        params = turn.body
    # Archived only when asked: header, or the `archive` field (never sent upstream).
    capture = archive_capture.chat_capture(
        request, params, asked=params.pop(archive_capture.BODY_FIELD, None), api="native",
        endpoint="/chat", model=req.model, stream=req.stream)
    if req.stream:
        params["stream_options"] = {"include_usage": True}
    gen = Generation.start()

    # A non-streamed answer is awaited watching the client: one that leaves stops it.
    watch = None if req.stream else ClientWatch(request.receive)

    def open_relay(say: Callable[[str], None] | None) -> Awaitable[Relay]:
        return state.open_relay(
            req.model, "/v1/chat/completions", orjson.dumps(params),
            priority=request_priority(request), client=None if watch else request,
            on_progress=say, session_kv=None if turn is None else turn.kv,
        )

    def stream(relay: Relay) -> AsyncIterator[bytes]:
        gen.load_duration_ns = relay.lease.load_duration_ns
        absorb: Callable[[dict[str, Any]], str] = gen.absorb

        def done_event() -> bytes:
            return sse_event({"delta": {}, **_final(req.model, gen, with_message=False)})

        on_done: Callable[[], bytes] = done_event
        if turn is not None:
            absorb, on_done = tap_translated(turn, absorb, on_done)
        chunks = translated_stream(
            relay,
            absorb,
            on_text=lambda text: sse_event({"delta": {"content": text}, "done": False}),
            on_done=on_done,
            on_error=lambda exc: sse_event(exc.native_body()),
        )
        return chunks if capture is None else capture.tap_generation(chunks, gen)

    opened = await watched(watch, open_for_stream(
        open_relay,
        enabled=req.stream and state.settings.notify_model_swap,
        render_progress=lambda text: sse_event(
            {"delta": {"reasoning_content": text + "\n"}, "done": False}
        ),
        render_error=lambda exc: sse_event(exc.native_body()),
        body=stream,
        media_type="text/event-stream",
    ))
    if not isinstance(opened, Relay):
        return tagged(opened if capture is None else capture.attach(opened), turn)
    relay = opened
    gen.load_duration_ns = relay.lease.load_duration_ns
    if relay.status != 200 or not req.stream:
        body = await relay.read()
        if relay.status != 200:
            err = ModelyardError(upstream_message(body), model=req.model)
            payload = {**err.native_body(), "error": "upstream_error"}
            return tagged(_json(payload, relay.status), turn)
        answer = orjson.loads(body)
        gen.absorb(answer)
        if turn is not None:
            commit_body(turn, answer)
        if capture is not None:
            capture.save_generation(gen)
        whole = _json(_final(req.model, gen))
        return tagged(whole if capture is None else capture.attach(whole), turn)
    response = LeasedStream(stream(relay), relay, "text/event-stream")
    return tagged(response if capture is None else capture.attach(response), turn)


def _is_admin(request: Request) -> bool:
    """Admins see the full reports; clients what front/redact.py keeps."""
    return principal_of(request).can("admin")


async def models(request: Request) -> Response:
    state = state_of(request)
    running = await state.engine_models()
    out = []
    for entry in state.registry.entries():
        m = running.get(entry.id, {})
        out.append(
            {
                "model": entry.name,
                "aliases": state.registry.aliases_of(entry.name),
                "origin": entry.origin,
                "preset": entry.preset.model_dump() if entry.preset else None,
                "loaded": m.get("state") == "ready",
                "backend": entry.spec.backend,
                "format": entry.format,
                "source": entry.source,
                "size_bytes": entry.size_bytes,
                "local_path": str(entry.path) if entry.path else None,
                "mmproj": str(mmproj) if (mmproj := getattr(entry.spec, "mmproj", None)) else None,
                "load_duration": m.get("load_duration_s"),
                "engine": m.get("engine"),
            }
        )
    return _json({"models": out if _is_admin(request) else client_models(out)})


async def health(request: Request) -> Response:
    state = state_of(request)
    engines_up = sum(1 for e in state.engines if e.up)
    running = await state.engine_models()
    mem = psutil.virtual_memory()
    healthy = engines_up == len(state.engines) and engines_up > 0
    return _json(
        {
            "status": "healthy" if healthy else "degraded",
            "version": __version__,
            "uptime_seconds": round(time.time() - state.started_at, 3),
            "engines": {"total": len(state.engines), "up": engines_up},
            "models_available": len(state.registry.entries()),
            "models_cached": sum(1 for m in running.values() if m["state"] == "ready"),
            "cache_limit": None,
            "downloads_active": 0,
            "downloads_queued": 0,
            "gpu_status": "available" if state.gpu_count else "unavailable",
            "gpu_count": state.gpu_count,
            "memory": {
                "host_total_bytes": mem.total,
                "host_available_bytes": mem.available,
                "host_used_percent": mem.percent,
            },
        }
    )


async def status(request: Request) -> Response:
    view = await state_of(request).status_view()
    return _json(view if _is_admin(request) else client_status(view))


async def overview_status(request: Request) -> Response:
    """GET /v1/status: devices, engines, services, scheduler, queues and pulls in one JSON."""
    state = state_of(request)
    if not _is_admin(request):
        return _json(client_overview(await state.status_view()))
    pulls = [j for j in await state.jobs.list() if j["status"] in ACTIVE] if state.jobs else []
    return _json(overview(await state.status_view(), pulls))


async def diag(request: Request) -> Response:
    state = state_of(request)
    engines = []
    for engine in state.engines:
        try:
            engines.append({"name": engine.name, "up": True, **await engine.diag()})
        except ModelyardError as exc:
            engines.append({"name": engine.name, "up": False, "error": exc.message})
    if not _is_admin(request):
        return _json(client_diag({"engines": engines}))
    llama = state.settings.resolve_llama_server()
    return _json(
        {
            "engines": engines,
            "llama_server": str(llama) if llama else None,
            "home": str(state.settings.home),
        }
    )


routes = [
    Route("/chat", chat, methods=["POST"]),
    Route("/models", models, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/status", status, methods=["GET"]),
    Route("/v1/status", overview_status, methods=["GET"]),
    Route("/diag", diag, methods=["GET"]),
]
