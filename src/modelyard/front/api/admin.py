"""Admin routes: load and unload models explicitly, and see every engine.

    POST /admin/models/{id}/load     {"keep_alive_s": 600}  (optional body)
    POST /admin/models/{id}/unload   waits for requests in flight, then unloads on every engine
    GET  /admin/engines              each engine: up, device memory, scheduler figures, models
    POST /admin/reload               re-read the config file (front/ops/reload.py); 400 names the
                                     field of an invalid one, which changes nothing
    GET  /admin/doctor               `modelyard doctor`: each engine's GPUs, driver, NVML
                                     accounting and backends, the host's RAM and disks, and each
                                     problem with its fix (front/ops/doctor.py, wire/doctor.py)
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard.front.ops.doctor import server_report
from modelyard.front.state import read_json_object, state_of, validate


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keep_alive_s: float | None = None


def _json(payload: Any) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


async def load(request: Request) -> Response:
    state = state_of(request)
    entry = state.catalog.registry.resolve(request.path_params["model"])
    body = await read_json_object(request) if await request.body() else {}
    req = validate(LoadRequest, body)
    engine = await state.dispatch.route(entry)
    result = await engine.load(entry.id, req.keep_alive_s)
    return _json({**result, "engine": engine.name})


async def unload(request: Request) -> Response:
    state = state_of(request)
    entry = state.catalog.registry.resolve(request.path_params["model"])
    unloaded_from = []
    for engine in state.dispatch.engines:
        if not engine.up:
            continue
        result = await engine.unload(entry.id)
        if result.get("status") == "unloaded":
            unloaded_from.append(engine.name)
    status = "unloaded" if unloaded_from else "not_loaded"
    return _json({"model": entry.id, "status": status, "engines": unloaded_from})


async def engines(request: Request) -> Response:
    state = state_of(request)
    reports = await state.dispatch.engine_statuses()
    return _json({"engines": [r.to_json() for r in reports],
                  "queues": state.dispatch.queues.stats()})


async def reload(request: Request) -> Response:
    return _json(await state_of(request).ops.reloader.reload())


async def doctor(request: Request) -> Response:
    state = state_of(request)
    report = await server_report(state.catalog.settings, list(state.dispatch.engines))
    return _json(report.model_dump(mode="json"))


routes = [
    Route("/admin/models/{model:path}/load", load, methods=["POST"]),
    Route("/admin/models/{model:path}/unload", unload, methods=["POST"]),
    Route("/admin/engines", engines, methods=["GET"]),
    Route("/admin/reload", reload, methods=["POST"]),
    Route("/admin/doctor", doctor, methods=["GET"]),
]
