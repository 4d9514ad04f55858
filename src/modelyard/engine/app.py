"""The engine's internal HTTP API, on a loopback port (the node's address in a cluster), called
only by the front.

    GET    /health                      liveness, and the port of the lease channel
    GET    /status                      models, their state and leases
    GET    /diag                        the device this engine owns
    GET    /doctor                      its GPUs, driver, NVML accounting and backends' builds
                                        (wire/doctor.py EngineDoctor; takes seconds: torch is
                                        asked in a child process)
    POST   /models/{id}/load            load a model (evicting if needed) and keep it per keep-alive
    POST   /models/{id}/unload          unload a model once its requests in flight are done
    POST   /rescan                      take the front's catalog (wire/catalog.py: the body), or
                                        (empty body, a local engine) re-read it
    POST   /reload                      take up a new configuration (the front's, as JSON)
    GET    /logs?model=&after=&limit=   a model's backend log: {"lines": […], "next_after": seq}
    GET    /logs/stream?model=&after=   the same, followed: one JSON batch per line (NDJSON), an
                                        empty batch now and then while nothing is written
    GET    /kv/{id}/slots               {"slots": n | null}: the slots its server saves (session KV)
    POST   /kv/{id}/slots/{n}           {"action": "restore"|"save", "key"}: → {"ok": bool}
    POST   /kv/drop                     {"key"}: delete a session's saved slots

Leases are not taken here but over the lease channel (engine/lease_channel.py): it is cheaper,
and it releases the leases of a front whose connection drops. Errors use the native shape so the
front can rebuild the same ModelyardError.

Only the front may call it (DESIGN.md §3.12): any local process can reach a loopback port, and a
web page in a browser on this machine can POST to one. Every request must therefore carry
`Authorization: Bearer <the engine's secret>` (401 unauthorized), name a loopback host with this
engine's port in Host (421 host_not_allowed: a DNS-rebound page names its own host), and a POST
must say `Content-Type: application/json` (415 unsupported_media_type: the one body type a page
cannot send without a CORS preflight, which this API never answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
from collections.abc import AsyncIterator

import orjson
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from modelyard import __version__, metrics
from modelyard.config import Settings
from modelyard.engine.doctor import engine_report
from modelyard.engine.lease_channel import engine_protocol, serve_lease_channel
from modelyard.engine.logs import model_log
from modelyard.engine.loop import Engine
from modelyard.engine.session_slots import SessionSlots
from modelyard.errors import (
    HostNotAllowed,
    InvalidRequest,
    ModelyardError,
    Unauthorized,
    UnsupportedMediaType,
)
from modelyard.wire.catalog import CatalogSnapshot
from modelyard.wire.logs import MAX_LIMIT


def _error(exc: ModelyardError) -> Response:
    return JSONResponse(exc.native_body(), status_code=exc.status, headers=exc.headers())


class RequireFront:
    """Refuses every request that is not the front's: see the module's docstring. One header
    scan per request; the hot path (leases) does not come through here."""

    def __init__(self, app: ASGIApp, secret: str, address: str = "127.0.0.1") -> None:
        if not secret:
            raise ValueError("the engine's HTTP API needs a secret")
        self.app = app
        self._authorization = f"Bearer {secret}".encode()
        # The hosts a caller may name: loopback, and the node's address in a cluster.
        self._hosts = ("127.0.0.1", "localhost", "[::1]", address)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refused = self._refusal(scope) if scope["type"] == "http" else None
        if refused is None:
            await self.app(scope, receive, send)
        else:
            await _error(refused)(scope, receive, send)

    def _refusal(self, scope: Scope) -> ModelyardError | None:
        headers = dict(scope["headers"])
        server = scope.get("server")
        port = server[1] if server else None
        host = headers.get(b"host", b"").decode("latin-1").lower()
        if port is None or host not in (f"{h}:{port}" for h in self._hosts):
            return HostNotAllowed(f"Host {host!r} is not this engine's address")
        if not hmac.compare_digest(headers.get(b"authorization", b""), self._authorization):
            return Unauthorized("the engine's API takes only its front's secret")
        if scope["method"] == "POST":
            media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if media != b"application/json":
                return UnsupportedMediaType(
                    f"the engine takes application/json, not {media.decode('latin-1')!r}"
                )
        return None


def create_engine_app(
    engine: Engine, *, secret: str, watch_parent: bool = False
) -> ASGIApp:
    """The engine's API, for callers that know `secret` (see the module's docstring)."""
    lease_port: int | None = None

    async def health(_: Request) -> Response:
        return JSONResponse(
            {"status": "ok", "engine": engine.index, "version": __version__,
             "protocol": engine_protocol(), "lease_port": lease_port}
        )

    async def status(_: Request) -> Response:
        return JSONResponse(engine.status().to_json())

    async def diag(_: Request) -> Response:
        return JSONResponse(engine.diag())

    async def doctor(_: Request) -> Response:
        found = await asyncio.to_thread(engine_report, engine)
        return JSONResponse(found.model_dump(mode="json"))

    async def load(request: Request) -> Response:
        name = request.path_params["model"]
        keep_alive = request.query_params.get("keep_alive_s")
        try:
            lease = await engine.acquire(
                name, keep_alive_s=float(keep_alive) if keep_alive is not None else None
            )
        except ModelyardError as exc:
            return _error(exc)
        engine.release(lease.id)
        return JSONResponse({"model": lease.model, "status": "loaded",
                             "load_duration_ns": lease.load_duration_ns})

    async def rescan(request: Request) -> Response:
        body = await request.body()
        try:
            snapshot = CatalogSnapshot.from_json(orjson.loads(body)) if body else None
            await engine.rescan(snapshot)
        except (orjson.JSONDecodeError, ValueError) as exc:  # BadCatalog, a bad entry
            return _error(InvalidRequest(f"rescan: not a catalog: {exc}"))
        return JSONResponse({"models": len(engine.registry.entries()),
                             "missing_files": list(engine.catalog.missing)})

    async def reload(request: Request) -> Response:
        try:
            settings = Settings.model_validate(orjson.loads(await request.body()))
        except (orjson.JSONDecodeError, ValidationError) as exc:
            return _error(InvalidRequest(f"reload: not a configuration: {exc}"))
        return JSONResponse(await engine.reload(settings))

    async def unload(request: Request) -> Response:
        try:
            unloaded = await engine.unload(request.path_params["model"])
        except ModelyardError as exc:
            return _error(exc)
        return JSONResponse({"model": request.path_params["model"],
                             "status": "unloaded" if unloaded else "not_loaded"})

    def _log_query(request: Request) -> tuple[str, int | None, int]:
        model = request.query_params.get("model", "")
        try:
            raw_after = request.query_params.get("after")
            after = int(raw_after) if raw_after not in (None, "") else None
            limit = min(MAX_LIMIT, max(1, int(request.query_params.get("limit", "200"))))
        except ValueError as exc:
            raise InvalidRequest(f"logs: {exc}") from exc
        if not model:
            raise InvalidRequest("logs: name a model", param="model")
        engine.registry.resolve(model)  # 404 model_not_found for a model it does not know
        return model, after, limit

    async def read_log(request: Request) -> Response:
        try:
            model, after, limit = _log_query(request)
        except ModelyardError as exc:
            return _error(exc)
        lines, cursor = await asyncio.to_thread(
            model_log(engine.settings, model).read, after, limit)
        return Response(orjson.dumps({"lines": [x.to_json() for x in lines],
                                      "next_after": cursor}), media_type="application/json")

    async def follow_log(request: Request) -> Response:
        try:
            model, after, _ = _log_query(request)
        except ModelyardError as exc:
            return _error(exc)

        async def batches() -> AsyncIterator[bytes]:
            follower = model_log(engine.settings, model).follow(after or 0)
            async with contextlib.aclosing(follower):
                async for batch in follower:
                    yield orjson.dumps({"lines": [x.to_json() for x in batch]}) + b"\n"

        return StreamingResponse(batches(), media_type="application/x-ndjson")

    async def kv_slots(request: Request) -> Response:
        return JSONResponse({"slots": slots.slots(request.path_params["model"])})

    async def kv_slot(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
            ok = await slots.act(request.path_params["model"], int(request.path_params["slot"]),
                                 str(body.get("action")), str(body.get("key")))
        except (orjson.JSONDecodeError, AttributeError) as exc:
            return _error(InvalidRequest(f"slot: not a JSON object: {exc}"))
        except ModelyardError as exc:
            return _error(exc)
        return JSONResponse({"ok": ok})

    async def kv_drop(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
            slots.drop(str(body.get("key")))
        except (orjson.JSONDecodeError, AttributeError) as exc:
            return _error(InvalidRequest(f"drop: not a JSON object: {exc}"))
        except ModelyardError as exc:
            return _error(exc)
        return JSONResponse({"ok": True})

    slots = SessionSlots(engine)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        nonlocal lease_port
        watcher = asyncio.create_task(_exit_with_parent()) if watch_parent else None
        metrics.prepare()  # not on the first load's time
        engine.start()
        channel = await serve_lease_channel(engine, secret, engine.settings.node_address)
        lease_port = int(channel.sockets[0].getsockname()[1])
        try:
            yield
        finally:
            channel.close()
            if watcher is not None:
                watcher.cancel()
            await slots.close()
            await engine.shutdown()

    routes = [
        Route("/health", health),
        Route("/status", status),
        Route("/diag", diag),
        Route("/doctor", doctor),
        Route("/models/{model:path}/load", load, methods=["POST"]),
        Route("/models/{model:path}/unload", unload, methods=["POST"]),
        Route("/rescan", rescan, methods=["POST"]),
        Route("/reload", reload, methods=["POST"]),
        Route("/logs", read_log),
        Route("/logs/stream", follow_log),
        Route("/kv/drop", kv_drop, methods=["POST"]),
        Route("/kv/{model:path}/slots", kv_slots),
        Route("/kv/{model:path}/slots/{slot:int}", kv_slot, methods=["POST"]),
    ]
    return RequireFront(Starlette(routes=routes, lifespan=lifespan), secret,
                        engine.settings.node_address)


async def _exit_with_parent() -> None:
    """An engine whose front died must not linger holding a device; SIGTERM ourselves."""
    import signal

    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)

