"""Admin routes of a cluster front (`cluster.mode: ray`, docs/cluster.md): its nodes, and drain.

    GET  /admin/cluster          {"mode": "ray"|"off", "storage_id": ..., "nodes": [...]}: each
                                 node's report (wire/cluster.py NodeReport) with, per engine, its
                                 name and the models it has loaded, and whether the node shares
                                 the front's model storage
    POST /admin/cluster/drain    {"host": "n2", "drain": true}: no new loads on that node (its
                                 loaded models keep serving); `false` ends the drain.
                                 404 node_not_found, 409 cluster_off on a single-machine front

The provider is a cluster only when it is a `ClusterView` (wire/engines.py): the RayProvider.
A single-machine front answers GET with mode `off` and no nodes (a question, not a mistake),
and a drain with 409 cluster_off.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard.config import Settings
from modelyard.errors import ClusterOff
from modelyard.front.state import read_json_object, state_of, validate
from modelyard.wire.cluster import STORAGE_ID_FILE, NodeReport, engine_name
from modelyard.wire.engines import ClusterView
from modelyard.wire.status import EngineReport


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = Field(min_length=1, description="The node's host name (`modelyard cluster "
                      "status` lists them).")
    drain: bool = Field(True, description="true: no new loads there; false: take loads again.")


def _json(payload: Any) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


def _front_storage_id(settings: Settings) -> str | None:
    try:
        return (settings.models_dir / STORAGE_ID_FILE).read_text().strip() or None
    except OSError:
        return None


def _storage(settings: Settings, node: NodeReport, front_id: str | None) -> str:
    """`shared`: the node reads the front's model files; `local`: it keeps (pulls) its own."""
    mode = settings.cluster.storage
    if mode != "auto":
        return mode
    return "shared" if front_id is not None and node.storage_id == front_id else "local"


def node_json(settings: Settings, node: NodeReport, statuses: dict[str, EngineReport],
              front_id: str | None) -> dict[str, Any]:
    """A node's report, each engine with its front-side name and the models loaded on it
    (`models_loaded` null: the front has no answer from that engine now)."""
    out = node.to_json()
    engines = []
    for endpoint in out["engines"]:
        name = engine_name(node.host, int(endpoint["index"]))
        report = statuses.get(name)
        loaded = None
        if report is not None and report.status is not None:
            loaded = [m.model for m in report.status.models if m.state == "ready"]
        engines.append({**endpoint, "name": name, "models_loaded": loaded})
    out["engines"] = engines
    out["storage"] = _storage(settings, node, front_id)
    return out


async def cluster(request: Request) -> Response:
    state = state_of(request)
    provider = state.dispatch.provider
    if not isinstance(provider, ClusterView):
        return _json({"mode": "off", "storage_id": None, "nodes": []})
    settings = state.catalog.settings
    statuses = {r.name: r for r in await state.dispatch.engine_statuses()}
    front_id = await asyncio.to_thread(_front_storage_id, settings)
    nodes = [node_json(settings, n, statuses, front_id) for n in provider.nodes()]
    return _json({"mode": "ray", "storage_id": front_id, "nodes": nodes})


async def drain(request: Request) -> Response:
    state = state_of(request)
    req = validate(DrainRequest, await read_json_object(request))
    provider = state.dispatch.provider
    if not isinstance(provider, ClusterView):
        raise ClusterOff()
    report = await provider.drain(req.host, req.drain)  # NodeNotFound: 404 node_not_found
    return _json(report.to_json())


routes = [
    Route("/admin/cluster", cluster, methods=["GET"]),
    Route("/admin/cluster/drain", drain, methods=["POST"]),
]
