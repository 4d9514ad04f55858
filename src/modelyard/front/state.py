"""What every front handler shares: settings, registry, engines and the upstream client."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from modelyard.config import Settings
from modelyard.errors import EngineUnavailable, InvalidRequest
from modelyard.front.engines import EngineClient
from modelyard.front.proxy import Relay
from modelyard.front.routing import EngineView, pick_engine
from modelyard.store.registry import ModelRegistry

M = TypeVar("M", bound=BaseModel)


@dataclass
class FrontState:
    settings: Settings
    registry: ModelRegistry
    engines: list[EngineClient]
    upstream: aiohttp.ClientSession
    gpu_count: int = 0
    started_at: float = field(default_factory=time.time)
    # Where each model was last granted: the routing hint "already resident".
    residency: dict[str, str] = field(default_factory=dict)

    def engine_for(self, model_id: str) -> EngineClient:
        if len(self.engines) == 1 and self.engines[0].up:
            return self.engines[0]  # nothing to choose: skip building the views
        views = [
            EngineView(
                name=e.name,
                up=e.up,
                resident=frozenset([model_id]) if self.residency.get(model_id) == e.name else
                frozenset(),
            )
            for e in self.engines
        ]
        name = pick_engine(views, model_id, default=self.engines[0].name if self.engines else None)
        if name is None:
            raise EngineUnavailable(
                "no engine is up to serve this request; they are being restarted",
                model=model_id,
                retry_after_s=2.0,
            )
        return next(e for e in self.engines if e.name == name)

    async def open_relay(self, model: str, path: str, payload: bytes) -> Relay:
        """Lease `model` on an engine and send it the request; the caller owns `relay.close()`."""
        entry = self.registry.resolve(model)
        engine = self.engine_for(entry.id)
        lease = await engine.acquire(entry.id)
        self.residency[entry.id] = engine.name
        relay = Relay(engine, lease)
        try:
            await relay.open(self.upstream, path, payload)
        except BaseException:
            relay.close()
            raise
        return relay


def state_of(request: Request) -> FrontState:
    state: FrontState = request.app.state.front
    return state


async def read_json_object(request: Request) -> dict[str, Any]:
    body = await request.body()
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    return data


def validate(model: type[M], data: dict[str, Any]) -> M:
    """Validate with pydantic; the first problem becomes a 400 naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        raise InvalidRequest(f"{where or 'body'}: {first['msg']}", param=where) from exc


def upstream_message(body: bytes) -> str:
    """The message inside an upstream error body, whatever its shape."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace")[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
    return str(data)[:500]

