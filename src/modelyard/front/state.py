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
from modelyard.front.queueing import Limits, ModelQueues, Slot
from modelyard.front.routing import EngineView, pick_engine
from modelyard.store.registry import Entry, ModelRegistry
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
    queues: ModelQueues = field(default_factory=ModelQueues)
    # Requests in flight per engine: "least queued work" when routing a cold model.
    inflight: dict[str, int] = field(default_factory=dict)

    def _compatible(self, engine: EngineClient, entry: Entry) -> bool:
        spec = self.settings.engine_specs.get(engine.index)
        return spec is None or spec.backends is None or entry.spec.backend in spec.backends

    def engine_for(self, entry: Entry) -> EngineClient:
        if len(self.engines) == 1 and self.engines[0].up and entry.spec.engine is None:
            return self.engines[0]  # nothing to choose: skip building the views
        views = [
            EngineView(
                name=e.name,
                up=e.up,
                compatible=self._compatible(e, entry),
                resident=frozenset([entry.id]) if (e.name, entry.id) in self.upstreams else
                frozenset(),
                queued=self.inflight.get(e.name, 0),
            )
            for e in self.engines
        ]
        pinned = f"engine-{entry.spec.engine}" if entry.spec.engine is not None else None
        name = pick_engine(
            views, entry.id, pinned=pinned, default=f"engine-{self.settings.default_engine}"
        )
        if name is None:
            why = f"its pinned {pinned} is down or cannot run it" if pinned else "none is up"
            raise EngineUnavailable(
                f"no engine can serve '{entry.id}' now ({why}; engines that crashed are "
                "being restarted)",
                model=entry.id,
                retry_after_s=2.0,
            )
        return next(e for e in self.engines if e.name == name)

    def limits(self, entry: Entry, engine: EngineClient) -> Limits:
        """max_concurrency: the model's, else its engine's, else the server's (same for queues)."""
        engine_spec = self.settings.engine_specs.get(engine.index)
        concurrency = entry.spec.max_concurrency or (
            engine_spec.max_concurrency if engine_spec else None
        ) or self.settings.max_concurrency
        max_queue = entry.spec.max_queue
        return Limits(
            concurrency, self.settings.max_queue if max_queue is None else max_queue
        )

    async def admit(
        self, entry: Entry, engine: EngineClient, priority: int = 0
    ) -> Slot:
        """A place among the requests `entry` serves at once (waiting in its queue if need be)."""
        return await self.queues.acquire(
            entry.id, self.limits(entry, engine), priority=priority,
            timeout_s=self.settings.queue_timeout_s,
        )

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

    async def open_relay(
        self,
        model: str,
        path: str,
        payload: bytes,
        *,
        keep_alive_s: float | None = None,
        priority: int = 0,
        content_type: str = "application/json",
    ) -> Relay:
        """Queue for `model`, lease it on an engine and send it the request (`payload`, of
        `content_type`); the caller owns `relay.close()`, which gives back the lease and the
        queue slot."""
        entry = self.registry.resolve(model)
        engine = self.engine_for(entry)
        slot = await self.admit(entry, engine, priority)
        self.inflight[engine.name] = self.inflight.get(engine.name, 0) + 1

        def done() -> None:
            slot.release()
            self.inflight[engine.name] -= 1

        try:
            relay = await self._lease_and_send(
                engine, entry.id, path, payload, keep_alive_s, content_type
            )
        except BaseException:
            done()
            raise
        relay.on_close = done
        return relay

    async def _lease_and_send(
        self,
        engine: EngineClient,
        model_id: str,
        path: str,
        payload: bytes,
        keep_alive_s: float | None,
        content_type: str = "application/json",
    ) -> Relay:
        key = (engine.name, model_id)
        guess = self.upstreams.get(key)
        if guess is None:
            lease, response = await engine.acquire(model_id, keep_alive_s), None
        else:
            lease, response = await self._lease_while_sending(
                engine, model_id, guess, path, payload, keep_alive_s, content_type
            )
        self.upstreams[key] = lease.upstream
        if response is None:
            try:
                url = lease.upstream + path
                response = await send_upstream(
                    self.upstream, url, payload, lease.model, content_type
                )
            except BaseException:
                engine.release(lease)
                raise
        return Relay(engine, lease, response)

    async def _lease_while_sending(
        self,
        engine: EngineClient,
        model_id: str,
        guess: str,
        path: str,
        payload: bytes,
        keep_alive_s: float | None,
        content_type: str = "application/json",
    ) -> tuple[Lease, aiohttp.ClientResponse | None]:
        """Take the lease and, meanwhile, send the request where the model was last granted.

        An engine grants a ready model at once, so the grant nearly always names that upstream
        and the lease round trip adds no latency. The engine's answer always wins: if it names
        another upstream (the model was reloaded) or refuses, the early request is dropped —
        closing its connection stops the backend — and nothing of it reaches the client. A None
        response tells the caller to send the request itself.
        """
        early = asyncio.ensure_future(
            send_upstream(self.upstream, guess + path, payload, model_id, content_type)
        )
        try:
            lease = await engine.acquire(model_id, keep_alive_s)
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


def request_priority(request: Request) -> int:
    """`X-Modelyard-Priority: N`: higher is admitted first from a model's queue."""
    raw = request.headers.get("x-modelyard-priority")
    if raw is None:
        return 0
    try:
        return int(raw)
    except ValueError:
        raise InvalidRequest(
            f"X-Modelyard-Priority must be an integer, not {raw!r}", param="priority"
        ) from None


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

