"""The engine's internal HTTP API, on a loopback port, called only by the front.

    GET    /health                      liveness, and the port of the lease channel
    POST   /leases        {"model"}     a ready model and where to send its requests
    DELETE /leases/{id}                 the request is done
    GET    /status                      models, their state and leases
    GET    /diag                        the device this engine owns
    POST   /models/{name}/unload        stop a model once its requests are done
    GET    /models/{name}/logs?lines=N  the child's last log lines

The front takes leases over the lease channel (engine/lease_channel.py), which is cheaper and
releases a dead front's leases; the HTTP lease routes serve tools and tests. Errors use the
native shape so the front can rebuild the same ModelyardError.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelyard import __version__
from modelyard.engine.lease_channel import serve_lease_channel
from modelyard.engine.loop import Engine
from modelyard.errors import InvalidRequest, ModelyardError
from modelyard.hw.devices import describe_devices


def _error(exc: ModelyardError) -> Response:
    return JSONResponse(exc.native_body(), status_code=exc.status, headers=exc.headers())


def create_engine_app(engine: Engine, *, watch_parent: bool = False) -> Starlette:
    lease_port: int | None = None

    async def health(_: Request) -> Response:
        return JSONResponse(
            {"status": "ok", "engine": engine.index, "version": __version__,
             "lease_port": lease_port}
        )

    async def acquire(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
            model = body.get("model") if isinstance(body, dict) else None
            if not isinstance(model, str):
                raise InvalidRequest("`model` must be a string", param="model")
            lease = await engine.acquire(model)
        except orjson.JSONDecodeError:
            return _error(InvalidRequest("body is not valid JSON"))
        except ModelyardError as exc:
            return _error(exc)
        return Response(orjson.dumps(lease.to_json()), media_type="application/json")

    async def release(request: Request) -> Response:
        engine.release(request.path_params["lease_id"])
        return Response(status_code=204)

    async def status(_: Request) -> Response:
        return JSONResponse(engine.status())

    async def diag(_: Request) -> Response:
        return JSONResponse({"engine": engine.index, "devices": describe_devices()})

    async def unload(request: Request) -> Response:
        try:
            stopped = await engine.unload(request.path_params["name"], drain_timeout_s=60)
        except ModelyardError as exc:
            return _error(exc)
        return JSONResponse({"unloaded": stopped})

    async def logs(request: Request) -> Response:
        try:
            lines = int(request.query_params.get("lines", "100"))
            return JSONResponse({"lines": engine.logs(request.path_params["name"], lines)})
        except ValueError:
            return _error(InvalidRequest("`lines` must be an integer", param="lines"))
        except ModelyardError as exc:
            return _error(exc)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        nonlocal lease_port
        watcher = asyncio.create_task(_exit_with_parent()) if watch_parent else None
        channel = await serve_lease_channel(engine)
        lease_port = int(channel.sockets[0].getsockname()[1])
        try:
            yield
        finally:
            channel.close()
            if watcher is not None:
                watcher.cancel()
            await engine.shutdown()

    routes = [
        Route("/health", health),
        Route("/leases", acquire, methods=["POST"]),
        Route("/leases/{lease_id}", release, methods=["DELETE"]),
        Route("/status", status),
        Route("/diag", diag),
        Route("/models/{name:path}/unload", unload, methods=["POST"]),
        Route("/models/{name:path}/logs", logs),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


async def _exit_with_parent() -> None:
    """An engine whose front died must not linger holding a device; SIGTERM ourselves."""
    import signal

    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)

