"""What every front handler shares: settings, registry, engines and the upstream client."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from modelyard.config import Settings
from modelyard.errors import EngineUnavailable, InvalidRequest, ModelyardError, UpstreamError
from modelyard.front.engines import EngineClient
from modelyard.front.proxy import Relay, send_upstream
from modelyard.front.routing import EngineView, pick_engine
from modelyard.store.registry import ModelRegistry
from modelyard.types import Lease

M = TypeVar("M", bound=BaseModel)


@dataclass
class FrontState:
    settings: Settings
    registry: ModelRegistry
    engines: list[EngineClient]
    upstream: aiohttp.ClientSession
    gpu_count: int = 0
    started_at: float = field(default_factory=time.time)
    # (engine, model) → upstream when last granted: where to send before the grant confirms it,
    # and the routing hint "already resident".
    upstreams: dict[tuple[str, str], str] = field(default_factory=dict)

    def engine_for(self, model_id: str) -> EngineClient:
        if len(self.engines) == 1 and self.engines[0].up:
            return self.engines[0]  # nothing to choose: skip building the views
        views = [
            EngineView(
                name=e.name,
                up=e.up,
                resident=frozenset([model_id]) if (e.name, model_id) in self.upstreams else
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

    async def engine_models(self) -> dict[str, dict[str, Any]]:
        """Every model the engines that answer know about, with the engine's name added."""
        models: dict[str, dict[str, Any]] = {}
        for engine in self.engines:
            try:
                status = await engine.status()
            except ModelyardError:
                continue
            for m in status["models"]:
                models[m["model"]] = {**m, "engine": engine.name}
        return models

    async def open_relay(self, model: str, path: str, payload: bytes) -> Relay:
        """Lease `model` on an engine and send it the request; the caller owns `relay.close()`."""
        entry = self.registry.resolve(model)
        engine = self.engine_for(entry.id)
        key = (engine.name, entry.id)
        guess = self.upstreams.get(key)
        if guess is None:
            lease, response = await engine.acquire(entry.id), None
        else:
            lease, response = await self._lease_while_sending(
                engine, entry.id, guess, path, payload
            )
        self.upstreams[key] = lease.upstream
        if response is None:
            try:
                url = lease.upstream + path
                response = await send_upstream(self.upstream, url, payload, lease.model)
            except BaseException:
                engine.release(lease)
                raise
        return Relay(engine, lease, response)

    async def _lease_while_sending(
        self, engine: EngineClient, model_id: str, guess: str, path: str, payload: bytes
    ) -> tuple[Lease, aiohttp.ClientResponse | None]:
        """Take the lease and, meanwhile, send the request where the model was last granted.

        An engine grants a ready model at once, so the grant nearly always names that upstream
        and the lease round trip adds no latency. The engine's answer always wins: if it names
        another upstream (the model was reloaded) or refuses, the early request is dropped —
        closing its connection stops the backend — and nothing of it reaches the client. A None
        response tells the caller to send the request itself.
        """
        early = asyncio.ensure_future(
            send_upstream(self.upstream, guess + path, payload, model_id)
        )
        try:
            lease = await engine.acquire(model_id)
        except BaseException:
            _drop(early)
            raise
        if lease.upstream != guess:
            _drop(early)
            return lease, None
        try:
            return lease, await early
        except UpstreamError:
            return lease, None  # e.g. it died since; one more try on the granted upstream
        except BaseException:
            engine.release(lease)
            raise


def _drop(early: asyncio.Future[aiohttp.ClientResponse]) -> None:
    """Abandon a request sent before its lease: close its response whenever it arrives."""

    def close(done: asyncio.Future[aiohttp.ClientResponse]) -> None:
        if not done.cancelled() and done.exception() is None:
            done.result().close()

    early.cancel()
    if early.done():
        close(early)
    else:
        early.add_done_callback(close)


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

