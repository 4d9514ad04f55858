"""The dispatcher: which engine serves a request, and the way there (queue slot, lease, the
request sent upstream).

It owns what routing and relaying remember between requests: the engines (through their
provider), the upstream HTTP session, where each model was last granted, the requests in flight
per engine, the model queues and the memory estimates. DESIGN.md §1 says how an engine is chosen.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, TypeVar

from starlette.types import Receive

from modelyard import metrics
from modelyard.config import EngineSpec, ServiceModel, Settings
from modelyard.errors import (
    ClientClosedRequest,
    EngineUnavailable,
    ModelyardError,
    QueueTimeout,
    UpstreamError,
)
from modelyard.front.catalog import Catalog
from modelyard.front.chat.presets import apply_preset_bytes
from modelyard.front.chat.sessions.kv import SessionKv, SlotKv
from modelyard.front.dispatch.fair_share import weight_of
from modelyard.front.dispatch.queueing import Limits, ModelQueues
from modelyard.front.dispatch.relay import Relay, discard_when_done, send_upstream
from modelyard.front.dispatch.replicas import MovedToCopy, Replicas, unless_moved
from modelyard.front.dispatch.reroute import Reroutes
from modelyard.front.dispatch.routing import EngineView, pick_engine, view_from_status
from modelyard.front.dispatch.swap_share import IDLE_GRACE_S, SwapLedger, swap_wait_s
from modelyard.front.dispatch.upstream import UpstreamPool, UpstreamResponse
from modelyard.front.engines.client import EngineClient
from modelyard.front.identity.principal import CURRENT_PRINCIPAL, owner_key
from modelyard.placement import policy as scheduler
from modelyard.placement.devices import LayerProfile
from modelyard.store.estimate import MemoryEstimate, estimate_model, serving_bytes
from modelyard.store.registry import Entry
from modelyard.types import Lease
from modelyard.wire.engines import EngineProvider
from modelyard.wire.lease import Ticket
from modelyard.wire.status import EngineReport, ModelStatus

T = TypeVar("T")


class EngineModel(NamedTuple):
    """A model an engine reported, and which engine."""

    engine: str
    status: ModelStatus


def engine_label(engine: int | str | None) -> str | None:
    """An engine as configured (`engine: 1`, or a cluster engine's name) → its name."""
    return f"engine-{engine}" if isinstance(engine, int) else engine


class Dispatcher:
    def __init__(
        self,
        catalog: Catalog,
        provider: EngineProvider,
        upstream: UpstreamPool,
        session_kv: SessionKv,
    ) -> None:
        self.catalog = catalog  # the settings and models in force (a reload replaces them)
        self.provider = provider  # which engines there are (front/engines/provider.py)
        self.upstream = upstream
        self.session_kv = session_kv  # chat sessions' KV slots (front/chat/sessions/kv.py)
        # (engine, model) → upstream when last granted: where to send before the grant
        # confirms it, and the routing hint "already resident".
        self.upstreams: dict[tuple[str, str], str] = {}
        # (engine, model) → the key of that upstream's load, sent with the early request.
        self.upstream_keys: dict[tuple[str, str], str | None] = {}
        self.queues = ModelQueues()
        self.swaps = SwapLedger()  # swap time per owner and engine (swap_share.py)
        self.clock = time.monotonic
        # Requests in flight per engine: "least queued work" when routing a cold model.
        self.inflight: dict[str, int] = {}
        self.estimates: dict[str, MemoryEstimate | None] = {}  # for routing
        # Copies of replicated models: which one a request goes to, scale up and down.
        self.replicas = Replicas(lambda: self.catalog.settings, lambda: self.catalog.registry)
        self.replicas.load = self._load_copy
        self.replicas.unload = self._unload_copy

    async def _load_copy(self, entry: Entry, keep_alive_s: float | None) -> str:
        """Load a copy of a replicated model (routing prefers an engine without a sibling);
        the engine's name."""
        engine = await self.route(entry)
        await engine.load(entry.id, keep_alive_s)
        return engine.name

    async def _unload_copy(self, engine_name: str, model: str) -> None:
        self.upstreams.pop((engine_name, model), None)  # not resident there any more
        engine = self.provider.view.get(engine_name)
        if engine is not None and engine.up:
            await engine.unload(model)

    @property
    def engines(self) -> tuple[EngineClient, ...]:
        """The engines now: the provider's current view (it may change between awaits)."""
        return self.provider.view.engines

    @property
    def gpu_count(self) -> int:
        return self.provider.gpu_count

    def _compatible(self, engine: EngineClient, entry: Entry) -> bool:
        """The engine may run the model's backend and has every capability it requires."""
        spec = engine_spec(self.catalog.settings, engine.name)
        if spec is None:
            return not entry.spec.requires
        backend_ok = spec.backends is None or entry.spec.backend in spec.backends
        return backend_ok and set(entry.spec.requires) <= set(spec.capabilities)

    def _holds(self, engine: EngineClient, model: str) -> bool:
        """Whether `engine` has `model` loaded now: its pushed status says (a grant's upstream
        hint outlives an eviction), else the hint."""
        status = engine.latest_status()
        if status is not None:
            return any(m.model == model and m.resident for m in status.models)
        return (engine.name, model) in self.upstreams

    def _draining(self, engine: EngineClient) -> bool:
        """A cluster node being drained takes no new loads (its loaded models still serve)."""
        draining = getattr(self.provider, "draining", None)
        return bool(draining is not None and draining(engine.name))

    async def route(self, entry: Entry, exclude: frozenset[str] = frozenset()) -> EngineClient:
        """The engine that serves `entry` (DESIGN.md §1: pinned, resident, default, least
        loaded), never one in `exclude` (tried already). For a cold model among several
        engines, each engine's snapshot says how many evictions loading it there would take."""
        metrics.note_model(entry.id)  # the request being served, if any, is for this model
        if (len(self.engines) == 1 and self.engines[0].up and entry.spec.engine is None
                and not exclude):
            return self.engines[0]  # nothing to choose
        pinned = engine_label(entry.spec.engine)
        default = self.catalog.settings.default_engine
        hinted = any((e.name, entry.id) in self.upstreams for e in self.engines if e.up)
        if pinned is None and not hinted:
            views = await self._snapshot_views(entry)
        else:
            views = [
                EngineView(
                    name=e.name,
                    up=e.up,
                    compatible=self._compatible(e, entry) and (
                        not self._draining(e) or self._holds(e, entry.id)),
                    resident=frozenset([entry.id]) if (e.name, entry.id) in self.upstreams
                    else frozenset(),
                    queued=self.inflight.get(e.name, 0),
                )
                for e in self.engines
            ]
        if exclude:
            views = [replace(v, up=False) if v.name in exclude else v for v in views]
        name = pick_engine(
            views, entry.id, pinned=pinned,
            default=engine_label(default),
            avoid=self.replicas.avoid(entry.id),
        )
        if name is None:
            why = f"its pinned {pinned} is down or cannot run it" if pinned else "none is up"
            raise EngineUnavailable(
                f"no engine can serve '{entry.id}' now ({why}; engines that crashed are "
                "being restarted)",
                model=entry.id,
                retry_after_s=2.0,
            )
        chosen = self.provider.view.get(name)
        if chosen is None:  # removed while the views were taken: choose again
            return await self.route(entry, exclude)
        return chosen

    async def _snapshot_views(self, entry: Entry) -> list[EngineView]:
        want = await self._want(entry)

        async def view(engine: EngineClient) -> EngineView:
            if not engine.up:
                return EngineView(engine.name, up=False)
            # What the engine pushed (wire/lease.py State), else one /status round trip.
            snapshot = engine.latest_status()
            if snapshot is None:
                try:
                    snapshot = await engine.status()
                except ModelyardError:
                    return EngineView(engine.name, up=False)
            found = view_from_status(
                engine.name, snapshot, want, self.inflight.get(engine.name, 0)
            )
            if not self._compatible(engine, entry) or (
                    self._draining(engine) and entry.id not in found.resident):
                return EngineView(engine.name, compatible=False)
            return found

        engines = self.engines  # one view throughout: the set may change while status is read
        views = list(await asyncio.gather(*(view(e) for e in engines)))
        if not any(v.compatible and v.up for v in views):
            # It fits nowhere: let an engine say why (503 insufficient_memory, in words).
            views = [replace(v, compatible=self._compatible(e, entry))
                     for v, e in zip(views, engines, strict=True)]
        return views

    async def _want(self, entry: Entry) -> scheduler.Want:
        """What the engine's placement is asked for `entry`."""
        return scheduler.Want(
            model=entry.id,
            bytes=await self._want_bytes(entry),
            group=entry.spec.group,
            coexist_with=frozenset(entry.spec.can_coexist_with),
            priority=entry.spec.priority,
            # As the engine asks (engine/placement_flow.py `_decide`), so the prediction is its
            # decision.
            profile=self._profile(entry),
            offload=getattr(entry.spec, "offload", "off") == "auto",
            # A registered service is one process on one device: never split.
            splittable=not isinstance(entry.spec, ServiceModel),
            # A backend the engine's status lists in `cpu_backends` is placed in host RAM.
            backend=entry.spec.reach_backend,
        )

    async def _want_bytes(self, entry: Entry) -> int:
        if entry.id not in self.estimates:
            self.estimates[entry.id] = await asyncio.to_thread(
                estimate_model, entry.spec, self.catalog.settings
            )
        return serving_bytes(entry.spec, self.estimates[entry.id], file_bytes=entry.size_bytes)

    def _profile(self, entry: Entry) -> LayerProfile | None:
        found = self.estimates.get(entry.id)  # filled by _want_bytes, asked first
        return found.profile if found is not None else None

    def limits(self, entry: Entry, engine: EngineClient) -> Limits:
        """max_concurrency: the model's, else its engine's, else the server's (same for queues)."""
        settings = self.catalog.settings
        spec = engine_spec(settings, engine.name)
        concurrency = entry.spec.max_concurrency or (
            spec.max_concurrency if spec else None
        ) or settings.max_concurrency
        max_queue = entry.spec.max_queue
        queue = settings.max_queue if max_queue is None else max_queue
        if settings.worker_count > 1:
            # One of several workers: the engine's queue is the model's queue for all of them
            # (it sees every lease: engine/loop.py `_wait_slot` holds `max_queue` there), so
            # this worker sends on whatever could run or wait there, and refuses the rest.
            return Limits(concurrency + queue, 0)
        return Limits(concurrency, queue)

    async def engine_statuses(self) -> list[EngineReport]:
        """Every engine's /status, named; an engine that does not answer says why."""
        out = []
        for engine in self.engines:
            try:
                out.append(EngineReport(engine.name, await engine.status()))
            except ModelyardError as exc:
                out.append(EngineReport(engine.name, error=exc.message))
        return out

    async def running_models(self) -> dict[str, EngineModel]:
        """Every model the engines that answer know about, by id, with the engine's name."""
        models: dict[str, EngineModel] = {}
        for engine in self.engines:
            try:
                status = await engine.status()
            except ModelyardError:
                continue
            for m in status.models:
                models[m.model] = EngineModel(engine.name, m)
        return models

    async def loaded_models(self) -> set[str]:
        """Models loaded or loading on the engines that are up: what each engine pushed (no
        round trip), else one `/status` call (an engine that has not pushed yet)."""
        loaded: set[str] = set()
        for engine in self.engines:
            if not engine.up:
                continue
            status = engine.latest_status()
            if status is None:
                try:
                    status = await engine.status()
                except ModelyardError:
                    continue
            loaded.update(m.model for m in status.models if m.state in ("ready", "loading"))
        return loaded

    async def open_relay(
        self,
        model: str,
        path: str,
        payload: bytes,
        *,
        keep_alive_s: float | None = None,
        priority: int = 0,
        content_type: str = "application/json",
        client: Receive | None = None,
        on_progress: Callable[[str], None] | None = None,
        session_kv: SlotKv | None = None,
        affinity: str | None = None,
    ) -> Relay:
        """Queue for `model`, lease it on an engine and send it the request (`payload`, of
        `content_type`); the caller owns `relay.close()`, which gives back the lease and the
        queue slot. With `client` (the client's ASGI receive channel), a client that
        disconnects while the request waits (in the queue, for a load) takes it out of the
        queue at once; `on_progress` hears what a load
        it waits for does (swap progress); `session_kv`: the slot a session turn restores
        before it is sent and saves after (front/chat/sessions/kv.py); `affinity`: a chat
        session, kept on the copy of a replicated model it used (front/dispatch/replicas.py)."""
        call = Call(path, payload, content_type, keep_alive_s, priority, on_progress, session_kv)
        entry = await self.catalog.resolve(model)
        if entry.preset is not None and call.content_type == "application/json":
            call = replace(call, payload=apply_preset_bytes(entry.preset, call.payload))
        served, over = self.replicas.choose(entry, affinity)
        if over is None:
            return await self._open(entry, call, client)
        while True:
            # A copy of a replicated model: an extra copy's keep-alive is the replicas' (its
            # own timer unloads it sooner), and a session's slots are the copy's.
            call = replace(call, keep_alive_s=self.replicas.keep_alive_s(served.id, keep_alive_s))
            if session_kv is not None:
                session_kv.model = served.id
            try:
                relay = await self._open(served, call, client)
            except MovedToCopy as moved:  # it waited; a new copy has room sooner
                over()
                served, over = self.replicas.take(entry, moved.copy, affinity)
                continue
            except BaseException:
                over()
                raise
            relay.on_close = _then(relay.on_close, over)
            return relay

    async def _open(self, entry: Entry, call: Call, client: Receive | None) -> Relay:
        engine = await self.route(entry)
        limits = self.limits(entry, engine)
        # Waiting (a full queue, a cold model) watches the client, so one that leaves stops
        # waiting; a request served at once skips the watch, which costs two tasks.
        must_wait = (
            self.queues.running(entry.id) >= limits.max_concurrency
            or self.queues.queued(entry.id) > 0
            or (engine.name, entry.id) not in self.upstreams
        )
        work = self._open_relay_elsewhere_if_down(entry, engine, limits, call)
        if client is None or not must_wait:
            return await work
        return await unless_disconnected(client, work, Relay.close)

    async def _open_relay_elsewhere_if_down(
        self, entry: Entry, engine: EngineClient, limits: Limits, call: Call
    ) -> Relay:
        """`_open_relay`; if its engine went down (silent, crashed, removed) before the grant,
        nothing was sent to the client yet: another engine that can serve it takes it, each
        engine once, within the queue timeout (front/dispatch/reroute.py); else 503."""
        tries = Reroutes(self.catalog.settings.queue_timeout_s)
        while True:
            try:
                return await self._open_relay(entry, engine, limits, call,
                                              timeout_s=tries.remaining_s())
            except EngineUnavailable as exc:
                tries.failed(engine.name, exc, entry.id)  # raises when out of tries
                try:
                    engine = await self.route(entry, exclude=frozenset(tries.tried))
                except EngineUnavailable:
                    raise exc from None  # no other engine: the first reason is the client's
                limits = self.limits(entry, engine)

    async def _open_relay(
        self, entry: Entry, engine: EngineClient, limits: Limits, call: Call,
        timeout_s: float | None = None,
    ) -> Relay:
        # Fair share (fair_share.py, swap_share.py): whose request, at what weight.
        principal = CURRENT_PRINCIPAL.get()
        owner = owner_key(principal)
        fair = self.catalog.settings.fair_share
        if timeout_s is None:
            timeout_s = self.catalog.settings.queue_timeout_s
        if self.swaps.charged(engine.name, owner, self.clock(), fair.swap_window_s):
            held_from = self.clock()
            try:
                timeout_s = await self._swap_gate(entry, engine, owner, timeout_s)
            finally:  # a wait like the queue's, for the request's record (usage, activity)
                metrics.note_queue_wait(self.clock() - held_from)
        weight = weight_of(fair, principal)
        acquiring = self.queues.acquire(
            entry.id, limits, priority=call.priority, timeout_s=timeout_s, owner=owner,
            weight=weight,
        )
        if self.queues.running(entry.id) < limits.max_concurrency and (
                self.queues.queued(entry.id) == 0):
            slot = await acquiring  # admitted at once: no wait to watch
        else:
            with self.replicas.waiting(entry.id) as moved:  # a long wait adds a copy
                slot = await (acquiring if moved is None else unless_moved(acquiring, moved))
        self.inflight[engine.name] = self.inflight.get(engine.name, 0) + 1
        if self.catalog.settings.worker_count > 1:
            # The model's queue is the engine's (this worker's own never waits: limits), which
            # orders the wait there and bounds it by the queue timeout (left after a swap gate).
            call = replace(call, queue=Ticket(owner, weight, call.priority, timeout_s))

        def done() -> None:
            slot.release()
            self.inflight[engine.name] -= 1
            self.swaps.ended(entry.id, owner, self.clock())
            self.swaps.notify()  # demand changed: a request held back by its swaps looks again

        try:
            # A service keeps its URL across unload/reload: an early request could reach it
            # unloaded (and make it load behind the scheduler's back), yet be confirmed.
            early = entry.spec.backend != "service"
            relay = await self._lease_and_send(engine, entry.id, call, send_early=early,
                                               owner=owner)
        except BaseException:
            done()
            raise
        relay.on_close = done
        self.replicas.placed(entry.id, engine.name)
        return relay

    async def _swap_gate(
        self, entry: Entry, engine: EngineClient, owner: str, timeout_s: float
    ) -> float:
        """Hold back a request whose owner's swaps on `engine` are over `max_swap_share` while
        other owners use a model loaded there (swap_share.py); the queue timeout left."""
        deadline = self.clock() + timeout_s
        while not self._holds(engine, entry.id):
            # Models other owners use here: resident, or granted here before (they may be
            # waiting to load again: taking the memory would hold them back too).
            status = engine.latest_status()
            resident = set() if status is None else {m.model for m in status.models
                                                     if m.resident}
            used = resident | {m for e, m in self.upstreams if e == engine.name}
            now = self.clock()
            theirs = {m for m in used - {entry.id}
                      if (self.queues.owners(m) | self.swaps.recent(m, now)) - {owner}}
            needs = bool(theirs) and (status is None or bool(theirs - resident) or
                                      view_from_status(engine.name, status, await self._want(
                                          entry)).evictions_needed > 0)
            fair = self.catalog.settings.fair_share
            wait = swap_wait_s(
                self.swaps.charges.get(engine.name, ()), owner, now,
                window_s=fair.swap_window_s, max_share=fair.max_swap_share,
                others_demand=bool(theirs), needs_eviction=needs,
            )
            if wait is None:
                break
            if now >= deadline:
                raise QueueTimeout(
                    f"model '{entry.id}' waited the queue timeout of {timeout_s:g}s: its owner's "
                    f"swaps on {engine.name} are over max_swap_share "
                    f"({fair.max_swap_share:g} of {fair.swap_window_s:g}s) while others use it",
                    model=entry.id, retry_after_s=max(1.0, wait),
                )
            # re-checked when a slot frees, and at least once per grace (demand may end)
            await self.swaps.changed(min(wait, deadline - now, IDLE_GRACE_S) + 0.01)
        return max(0.0, deadline - self.clock())

    async def _lease_and_send(
        self, engine: EngineClient, model_id: str, call: Call, *, send_early: bool = True,
        owner: str = "",
    ) -> Relay:
        key = (engine.name, model_id)
        kv = call.kv
        # A session's KV is restored into its slot before the request may go.
        guess = self.upstreams.get(key) if send_early and kv is None else None
        response = None
        # The hot path: a lease at once (a model ready in this process's engine, a lease this
        # front gave back a moment ago), then the request; no task, no round trip.
        now = engine.lease_now(model_id, call.keep_alive_s) if send_early else None
        if now is not None:
            lease = now
        elif guess is None:
            lease = await engine.acquire(model_id, call.keep_alive_s, call.on_progress, call.queue)
        else:
            lease, response = await self._lease_while_sending(
                engine, model_id, guess, self.upstream_keys.get(key), call)
        if lease.load_duration_ns > 0:
            metrics.note_swap()
            fair = self.catalog.settings.fair_share
            self.swaps.charge(engine.name, model_id, lease.api_key, owner,
                              lease.load_duration_ns / 1e9, self.clock(), fair.swap_window_s,
                              reload=key in self.upstreams)
        self.upstreams[key] = lease.upstream
        self.upstream_keys[key] = lease.api_key
        self.session_kv.sending(lease.upstream, kv)
        if response is None:
            payload = call.payload
            try:
                if kv is not None:  # claim a slot, restore the session's KV there
                    payload = await kv.prepare(engine, lease.upstream, payload)
                response = await send_upstream(
                    self.upstream, lease.upstream + call.path, payload, lease.model,
                    call.content_type, lease.api_key,
                )
            except BaseException:
                if kv is not None:
                    kv.release()
                engine.release(lease)
                raise
        relay = Relay(engine, lease, response)
        relay.session = self.upstream
        if kv is not None:
            relay.on_release = lambda: kv.after(lease.upstream, ok=relay.status == 200)
        return relay

    async def _lease_while_sending(
        self, engine: EngineClient, model_id: str, guess: str, guess_key: str | None, call: Call
    ) -> tuple[Lease, UpstreamResponse | None]:
        """Take the lease and, meanwhile, send the request where the model was last granted.

        An engine grants a ready model at once, so the grant nearly always names that upstream
        and the lease round trip adds no latency. The engine's answer always wins: if it names
        another upstream or key (the model was reloaded) or refuses, the early request is dropped —
        closing its connection stops the backend — and nothing of it reaches the client. A None
        response tells the caller to send the request itself.
        """
        early = asyncio.ensure_future(
            send_upstream(
                self.upstream, guess + call.path, call.payload, model_id, call.content_type,
                guess_key,
            )
        )
        try:
            lease = await engine.acquire(model_id, call.keep_alive_s, call.on_progress, call.queue)
        except BaseException:
            _drop(early)
            raise
        if lease.upstream != guess or lease.api_key != guess_key:
            _drop(early)
            return lease, None
        try:
            return lease, await early
        except UpstreamError:
            return lease, None  # e.g. it died since; one more try on the granted upstream
        except BaseException:
            engine.release(lease)
            raise


def engine_spec(settings: Settings, name: str) -> EngineSpec | None:
    """Engine `name`'s overrides: `engine_specs` are keyed by the N of `engine-N` (of
    `<host>/engine-N` in a cluster: the same device group on every node)."""
    number = _engine_number(name)
    return settings.engine_specs.get(number) if number is not None else None


@functools.cache
def _engine_number(name: str) -> int | None:
    """N of `engine-N` or `<host>/engine-N` (once per name: `limits` asks per request)."""
    prefix, _, number = name.rpartition("/")[2].rpartition("-")
    return int(number) if prefix == "engine" and number.isdigit() else None


@dataclass(frozen=True)
class Call:
    """One request on its way to a backend, and how it asked to be served."""

    path: str
    payload: bytes
    content_type: str
    keep_alive_s: float | None
    priority: int
    on_progress: Callable[[str], None] | None
    kv: SlotKv | None = None
    queue: Ticket | None = None  # how it waits at the engine (serve --workers N: _open_relay)


def _then(first: Callable[[], None] | None, then: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        try:
            if first is not None:
                first()
        finally:
            then()

    return both


def _drop(early: asyncio.Future[UpstreamResponse]) -> None:
    """Abandon a request sent before its lease: close its response whenever it arrives."""
    discard_when_done(early, UpstreamResponse.close)


async def _disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the body must have been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(
    receive: Receive, work: Coroutine[Any, Any, T], discard: Callable[[T], None]
) -> T:
    """`await work`, unless the client (its ASGI `receive` channel) disconnects first: then
    `work` is cancelled (leaving its queue, dropping its wait for a grant) and
    ClientClosedRequest is raised. A result that arrives anyway is given to `discard`, also
    when this wait is itself cancelled (a shutdown, an enclosing wait whose client left) as
    `work` ends."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        discard_when_done(task, discard)  # it may have ended already: nobody else takes it
        raise
    finally:
        gone.cancel()
    if not (gone.done() and not gone.cancelled()):
        return task.result()  # the work ended and the client is still there
    discard_when_done(task, discard)
    await asyncio.wait({task})  # its cleanup (leaving the queue, the Cancel) runs first
    raise ClientClosedRequest("the client closed the connection while the request waited")

