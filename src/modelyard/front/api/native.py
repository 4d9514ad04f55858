"""modelyard's native API: /chat, /models, /health, /status, /diag.

`/chat` answers with Ollama-style statistics (nanoseconds); `stream: true` gives SSE chunks
`{"delta": {"content": …}, "done": false}` and a final `{"delta": {}, "done": true, …stats}`
(front/chat/render.py; the chat pipeline, front/chat/pipeline.py, runs the request).
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import psutil
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard import __version__
from modelyard.errors import ModelyardError
from modelyard.front.api.context import chat_context
from modelyard.front.archive import capture as archive_capture
from modelyard.front.chat import pipeline, render
from modelyard.front.chat.request import CHAT_PATH, ChatCall
from modelyard.front.chat.shapes import check_openai_chat, check_roles
from modelyard.front.chat.tools.support import check_tools_for
from modelyard.front.chat.vision import check_vision_for
from modelyard.front.dispatch.dispatcher import EngineModel
from modelyard.front.identity.principal import owner_key, principal_of
from modelyard.front.ops.jobs import ACTIVE
from modelyard.front.ops.overview import overview
from modelyard.front.ops.redact import client_diag, client_models, client_overview, client_status
from modelyard.front.ops.snapshot import Snapshot
from modelyard.front.state import (
    read_json_object,
    state_of,
    validate,
)


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


def native_call(req: NativeChatRequest) -> ChatCall:
    """The chat pipeline's request for a validated /chat body."""
    fields = req.model_dump(exclude_none=True)
    payload = {k: v for k, v in fields.items() if k != archive_capture.BODY_FIELD}
    if req.stream:
        payload["stream_options"] = {"include_usage": True}
    return ChatCall(
        "native", "/chat", req.model, CHAT_PATH, req.stream, payload, fields=fields,
        archive=fields.get(archive_capture.BODY_FIELD),
    )


async def chat(request: Request) -> Response:
    state = state_of(request)
    req = validate(NativeChatRequest, await read_json_object(request))
    call = native_call(req)
    # A malformed part or tool: 400 naming it, not the backend's 500.
    check_roles(call.own_fields.get("messages"))
    check_openai_chat(call.own_fields, mcp=False)  # no tool loop here: function tools only
    check_tools_for(state, req.model, call.own_fields)
    check_vision_for(state, req.model, call.own_fields)
    return await pipeline.answer(chat_context(request, call), call, render.NATIVE)


def _is_admin(request: Request) -> bool:
    """Admins see the full reports; clients what front/ops/redact.py keeps."""
    return principal_of(request).can("admin")


def _owner(request: Request) -> str:
    """Whose entries of the queues' `owners` a client sees (its own)."""
    return owner_key(principal_of(request))


async def models(request: Request) -> Response:
    state = state_of(request)
    running = await state.dispatch.running_models()
    out = []
    for entry in state.catalog.registry.entries():
        m = running.get(entry.id)
        out.append(
            {
                "model": entry.name,
                "aliases": state.catalog.registry.aliases_of(entry.name),
                "origin": entry.origin,
                "preset": entry.preset.model_dump() if entry.preset else None,
                "loaded": m is not None and m.status.state == "ready",
                "backend": entry.spec.backend,
                "format": entry.format,
                "source": entry.source,
                "size_bytes": entry.size_bytes,
                "local_path": str(entry.path) if entry.path else None,
                "mmproj": str(mmproj) if (mmproj := getattr(entry.spec, "mmproj", None)) else None,
                "load_duration": m.status.load_duration_s if m is not None else None,
                "engine": m.engine if m is not None else None,
            }
        )
    return _json({"models": out if _is_admin(request) else client_models(out)})


def _running_snapshot(request: Request) -> Snapshot[dict[str, EngineModel]]:
    """The app's shared engines' report for /health (made on first use: front/ops/snapshot.py)."""
    app_state = request.app.state
    snapshot: Snapshot[dict[str, EngineModel]] | None = getattr(
        app_state, "running_snapshot", None)
    if snapshot is None:
        dispatch = state_of(request).dispatch
        # A model granted where it was not before changes the dispatcher's upstream map.
        snapshot = Snapshot(dispatch.running_models, lambda: frozenset(dispatch.upstreams.items()))
        app_state.running_snapshot = snapshot
    return snapshot


async def health(request: Request) -> Response:
    state = state_of(request)
    engines_up = sum(1 for e in state.dispatch.engines if e.up)
    running = await _running_snapshot(request).get()
    mem = psutil.virtual_memory()
    healthy = engines_up == len(state.dispatch.engines) and engines_up > 0
    return _json(
        {
            "status": "healthy" if healthy else "degraded",
            "version": __version__,
            "uptime_seconds": round(time.time() - state.started_at, 3),
            "engines": {"total": len(state.dispatch.engines), "up": engines_up},
            "models_available": state.catalog.registry.count(),
            "models_cached": sum(1 for m in running.values() if m.status.state == "ready"),
            "cache_limit": None,
            "downloads_active": 0,
            "downloads_queued": 0,
            "gpu_status": "available" if state.dispatch.gpu_count else "unavailable",
            "gpu_count": state.dispatch.gpu_count,
            "memory": {
                "host_total_bytes": mem.total,
                "host_available_bytes": mem.available,
                "host_used_percent": mem.percent,
            },
        }
    )


async def status(request: Request) -> Response:
    view = await state_of(request).status_view()
    return _json(view if _is_admin(request) else client_status(view, _owner(request)))


async def overview_status(request: Request) -> Response:
    """GET /v1/status: devices, engines, services, scheduler, queues and pulls in one JSON."""
    state = state_of(request)
    if not _is_admin(request):
        return _json(client_overview(await state.status_view(), _owner(request)))
    pulls = [j for j in await state.catalog.jobs.list() if j["status"] in ACTIVE]
    return _json(overview(await state.status_view(), pulls))


async def diag(request: Request) -> Response:
    state = state_of(request)
    engines = []
    for engine in state.dispatch.engines:
        try:
            engines.append({"name": engine.name, "up": True, **await engine.diag()})
        except ModelyardError as exc:
            engines.append({"name": engine.name, "up": False, "error": exc.message})
    if not _is_admin(request):
        return _json(client_diag({"engines": engines}))
    llama = state.catalog.settings.resolve_llama_server()
    return _json(
        {
            "engines": engines,
            "llama_server": str(llama) if llama else None,
            "home": str(state.catalog.settings.home),
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
