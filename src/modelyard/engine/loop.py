"""The engine: owns one device's models, loads them on demand, evicts, and hands out leases.

All state here is mutated only from the engine's event loop, so there is one owner (DESIGN.md
§3.1) without locks on the state itself. What to load and what to evict is decided by the pure
policy in placement/policy.py; this module and its parts (`Engine`'s docstring) apply its
decisions:

* a burst of requests for a cold model joins one load task (§3.5);
* placement decisions are taken one at a time (``_placing``), and a model being loaded holds its
  estimated bytes in the ledger from the decision on, so two loads never promise the same memory;
  the loads themselves then run side by side;
* a model is busy while it has leases (§3.3) or requests waiting to lease it, and is never
  evicted or expired then (§3.4): a load that only busy models could make room for waits,
  bounded, and re-plans whenever a lease is released or a model unloads;
* loads that wait for memory are placed in arrival order (``_arrivals``), and a load nobody
  waits for any more (every client left) is dropped before it evicts anything;
* after an unload the engine waits until the device reports the memory back (§3.7);
* a failed load puts the model in a cooldown, so clients get a fast, explained 503;
* idle models unload after their keep-alive; pinned ones never do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable

from modelyard import metrics
from modelyard.config import ModelSpec, TransformersModel
from modelyard.engine.backends.base import Backend, make_backend
from modelyard.engine.backends.keys import sweep_stale_keys
from modelyard.engine.node_pull import pull_here, served_locally
from modelyard.engine.reload_flow import ConfigReload
from modelyard.engine.runtime import ModelState, Runtime, file_identity
from modelyard.engine.speculative import TRANSFORMERS_OFF, DraftCounts
from modelyard.engine.state import MIB
from modelyard.engine.warm_tier import Warmable
from modelyard.errors import (
    EngineCooling,
    ModelFilesMissing,
    ModelLoadFailed,
    ModelNotFound,
    ModelyardError,
    QueueFull,
    QueueTimeout,
)
from modelyard.hw.thermal import DEFAULT_THRESHOLDS, ThermalSensors, engine_paused
from modelyard.placement import policy as scheduler
from modelyard.placement.devices import Placement
from modelyard.store.draft import with_draft_path
from modelyard.store.estimate import estimate_model
from modelyard.store.registry import Entry
from modelyard.types import Lease
from modelyard.wire.catalog import CatalogSnapshot
from modelyard.wire.lease import Ticket

log = logging.getLogger("modelyard.engine")


class Engine(ConfigReload):
    """One device group's engine, the one entry point of this package. Its parts are classes
    over one shared state (engine/state.py), each one concept: the reports (reports.py), the
    warm-tier glue (warm_flow.py), placement and eviction (placement_flow.py), config reload
    (reload_flow.py); here: leases, unloading on request, background duties, the keep-alive
    reaper, loading and stopping."""

    # ---- leases ---------------------------------------------------------------------------

    def _runtime(self, entry: Entry) -> Runtime:
        rt = self._models.get(entry.id)
        if rt is None:
            rt = self._models[entry.id] = Runtime(entry)
        return rt

    async def acquire(
        self,
        name: str,
        *,
        keep_alive_s: float | None = None,
        progress: Callable[[str], None] | None = None,
        ticket: Ticket | None = None,
    ) -> Lease:
        """A lease on a ready copy of `name`, loading it first (and evicting) if needed;
        `progress` hears what a load does meanwhile (unloading X, loading Y, ready); `ticket`:
        how it waits for a slot (a worker of `serve --workers N`: `_wait_slot`)."""
        rt = self._runtime(await self._resolve(name))
        if progress is None or rt.state is ModelState.READY:
            return await self._acquire(rt, keep_alive_s, ticket)
        rt.listeners.add(progress)
        try:
            return await self._acquire(rt, keep_alive_s, ticket)
        finally:
            rt.listeners.discard(progress)

    async def _resolve(self, name: str) -> Entry:
        """The entry for `name`; a name it does not know yet (just pulled, imported) makes it
        re-read the catalog once."""
        entry = self.registry.get(name)
        if entry is None and not self.catalog.pushed_only:
            await self.rescan()
        entry = self.registry.resolve(name)
        if (self.catalog.missing and entry.path is not None and entry.hub is None
                and not entry.path.exists()):  # a pulled one is pulled here (`_pull_here`)
            raise ModelFilesMissing(
                f"the files of '{entry.name}' are not on this node ({entry.path}): it does not "
                "share the front's models_dir (same storage id at the same path)", model=name)
        return entry

    async def rescan(self, snapshot: CatalogSnapshot | None = None) -> None:
        """Take the catalog the front pushed; without one, rebuild it here (a local engine
        only: one whose catalog is pushed only keeps the last one). ValueError: a snapshot whose
        entries this version cannot read."""
        if snapshot is not None:
            registry = await asyncio.to_thread(self.catalog.accept, snapshot, self.settings)
            if registry is not None:
                self.registry = registry
        elif not self.catalog.pushed_only:
            self.registry = await asyncio.to_thread(self.catalog.build, self.settings)
        # A rescan is someone saying the disk changed (a file restored, a pull, an import):
        # models that failed may load now, so none waits out its load_cooldown_s.
        for rt in self._models.values():
            rt.cooldown_until = 0.0

    async def _acquire(self, rt: Runtime, keep_alive_s: float | None,
                       ticket: Ticket | None = None) -> Lease:
        # While it waits it counts among the model's waiters: the model is not idle (no
        # keep-alive expiry, no eviction) and its load is wanted. One that leaves without a
        # lease wakes the placer and the reaper, which may then drop the load or expire it.
        rt.waiters += 1
        try:
            lease = await self._lease(rt, keep_alive_s, ticket)
        except BaseException:
            rt.waiters -= 1
            self._notify()
            raise
        rt.waiters -= 1
        return lease

    async def _lease(self, rt: Runtime, keep_alive_s: float | None,
                     ticket: Ticket | None = None) -> Lease:
        started = self.clock()
        rt.keep_alive_s = keep_alive_s
        self._ensure_reaper()
        await self._wait_cool(rt)
        if rt.state is ModelState.READY and rt.server is not None and not rt.server.alive:
            # It died and the exit watcher has not run yet: reload instead of leasing a corpse.
            self._forget_dead_server(rt, rt.server)
        while rt.state is not ModelState.READY or rt.retiring is not None:
            if rt.retiring is not None:
                await asyncio.shield(rt.retiring)
                continue
            if self._models.get(rt.entry.id) is not rt:
                raise ModelNotFound(rt.entry.id)  # a reload removed it
            if rt.load is None:
                self._check_cooldown(rt)
                self._arrivals[rt.entry.id] = None
                rt.load = self._spawn(self._load(rt), f"load:{rt.entry.id}")
            await asyncio.shield(rt.load)
        if not self._slot_free(rt):
            await self._wait_slot(rt, ticket)  # granted below with no await between
            if rt.state is not ModelState.READY or rt.retiring is not None:
                self._hand_slot(rt)  # it went away meanwhile: the next one looks too
                return await self._lease(rt, keep_alive_s, ticket)
        return self._grant(rt, int((self.clock() - started) * 1e9))

    def _max_concurrency(self, rt: Runtime) -> int:
        """Leases of `rt` at once: the model's `max_concurrency`, else its engine's, else the
        server's (the front's queue uses the same rule, dispatcher.limits)."""
        spec = self.settings.engine_specs.get(self.index)
        return (rt.spec.max_concurrency or (spec.max_concurrency if spec else None)
                or self.settings.max_concurrency)

    def _slot_free(self, rt: Runtime) -> bool:
        return rt.slots.free(len(rt.leases), self._max_concurrency(rt))

    async def _wait_slot(self, rt: Runtime, ticket: Ticket | None = None) -> None:
        """Wait in `rt`'s slot queue until a release hands this request a turn.

        Under `serve --workers N` this queue is the model's queue for every worker (each
        worker's own admits `max_concurrency + max_queue`, dispatcher.limits): the engine
        sees every lease, so `max_queue` is held here, once for all of them, and the request's
        `ticket` orders it (priority, its owner's fair share) and bounds its wait
        (`queue_timeout_s`), as the front's queue does (front/dispatch/queueing.py)."""
        if self.settings.worker_count > 1:
            limit = rt.spec.max_queue
            limit = self.settings.max_queue if limit is None else limit
            if rt.slots.waiting >= limit:
                raise QueueFull(
                    f"model '{rt.entry.id}' is busy: {len(rt.leases)} running, "
                    f"{rt.slots.waiting} waiting (max_queue {limit}); retry in about "
                    f"{self._retry_after_s(rt):.0f}s",
                    model=rt.entry.id, retry_after_s=self._retry_after_s(rt))
        for listener in list(self.slot_wanted):
            listener(rt.entry.id)
        timeout_s = None if ticket is None else ticket.timeout_s
        if timeout_s is None:
            await rt.slots.wait(lambda: self._hand_slot(rt), ticket)
            return
        try:
            async with asyncio.timeout(timeout_s):
                await rt.slots.wait(lambda: self._hand_slot(rt), ticket)
        except TimeoutError:
            raise QueueTimeout(
                f"model '{rt.entry.id}' stayed busy for the queue timeout of {timeout_s:g}s "
                f"({len(rt.leases)} running, {rt.slots.waiting} waiting); retry in about "
                f"{self._retry_after_s(rt):.0f}s",
                model=rt.entry.id, retry_after_s=self._retry_after_s(rt)) from None

    def _retry_after_s(self, rt: Runtime) -> float:
        """When a retry would likely find a slot: the waiters ahead and it, spread over the
        slots, at a second each (the engine does not time its leases; the front's estimate,
        front/dispatch/queueing.py, starts from the same second)."""
        return max(1.0, (rt.slots.waiting + 1) / self._max_concurrency(rt))

    def _hand_slot(self, rt: Runtime) -> None:
        """Hand free slots of `rt` to the waiters at the head of its queue."""
        rt.slots.hand(len(rt.leases), self._max_concurrency(rt))

    def slots_wanted(self, model_id: str) -> bool:
        """Whether requests wait for a slot of `model_id` now."""
        rt = self._models.get(model_id)
        return rt is not None and rt.slots.waiting > 0

    def lease_ready(self, name: str, keep_alive_s: float | None = None) -> Lease | None:
        """A lease on `name` at once, without awaiting, if it is ready to serve now (the hot
        path: most requests find their model loaded); None says "ask `acquire`", which also
        covers every case this skips (unknown name, loading, retiring, a dead server, the
        device too hot). It runs on the event loop like the owner's steps and awaits nothing,
        so it cannot interleave with them (DESIGN.md §3.1)."""
        entry = self.registry.get(name)
        rt = None if entry is None else self._models.get(entry.id)
        if (rt is None or rt.state is not ModelState.READY or rt.retiring is not None
                or rt.server is None or not rt.server.alive or not self._cool.is_set()
                or not self._slot_free(rt)):
            return None
        rt.keep_alive_s = keep_alive_s
        self._ensure_reaper()
        return self._grant(rt, 0)  # nothing was loaded for it

    def _grant(self, rt: Runtime, load_duration_ns: int) -> Lease:
        assert rt.server is not None
        # Lease ids only need to be unique in this engine and unguessable to other fronts'
        # requests; 16 random bytes from the OS cost a fifth of uuid4's object.
        lease = Lease(
            id=secrets.token_hex(16),
            model=rt.entry.id,
            upstream=rt.server.url,
            load_duration_ns=load_duration_ns,
            api_key=rt.server.api_key,  # the front calls the backend with it
        )
        rt.leases.add(lease.id)
        self._leases[lease.id] = rt.entry.id
        return lease

    def release(self, lease_id: str) -> None:
        model_id = self._leases.pop(lease_id, None)
        if model_id is None:
            return
        rt = self._models[model_id]
        rt.leases.discard(lease_id)
        rt.last_used = self.clock()
        if rt.slots.waiting:
            self._hand_slot(rt)
        if rt.leases:
            return
        # Wake whoever must act now: a load waiting for this model to go idle, or the reaper if
        # this model expires before the reaper's next look. Usually nobody (the hot path).
        keep_alive = self._keep_alive(rt)
        expires = rt.last_used + keep_alive if keep_alive is not None else math.inf
        if self._waiters or expires < self._reaper_wakes_at:
            self._notify()
        counts = self._drafts.get(model_id)
        if counts is not None and rt.server is not None and counts.off_reason is None:
            # after the answer: off the request path
            counts.poke(rt.server.url, self._spawn, api_key=rt.server.api_key)

    def change_event(self) -> asyncio.Event:
        """Set at the next change of the models (loads, unloads, evictions, failures), for an
        observer (the lease channel's State frames). Not counted as a waiter: releases do not
        wake it (lease counts are not what it reports)."""
        return self._changed

    async def _wait_cool(self, rt: Runtime) -> None:
        if self._cool.is_set():
            return
        try:
            await asyncio.wait_for(self._cool.wait(), self.settings.memory_wait_timeout_s)
        except TimeoutError:
            raise EngineCooling(
                f"engine {self.index} is paused to cool down ({self.paused_reason})",
                model=rt.entry.id,
                retry_after_s=self.settings.thermal.poll_s * 2,
            ) from None

    def set_paused(self, reason: str | None) -> None:
        """Thermal protection: while paused, new work waits; running work finishes."""
        if reason == self.paused_reason:
            return
        if reason is not None:
            log.warning("engine %d paused: %s", self.index, reason)
            self.stats["thermal_pauses"] += 1
            self._cool.clear()
        else:
            log.info("engine %d resumed after cooling", self.index)
            self._cool.set()
        self.paused_reason = reason

    def _check_cooldown(self, rt: Runtime) -> None:
        remaining = rt.cooldown_until - self.clock()
        if remaining <= 0 or rt.last_error is None:
            return
        if file_identity(rt.entry.path) != rt.failed_file:  # restored or replaced: try again
            rt.cooldown_until = 0.0
            return
        err = rt.last_error
        raise type(err)(
            f"{err.message} (not retried for another {remaining:.0f} s: load_cooldown_s)",
            model=rt.entry.id,
            retry_after_s=remaining,
            log_tail=err.log_tail,
        )

    # ---- unloading on request -------------------------------------------------------------

    async def unload(self, name: str) -> bool:
        """Unload `name` once it is idle (admin route, keep_alive 0): waits for its leases."""
        rt = self._models.get(self.registry.resolve(name).id)
        if rt is None:
            return False
        if rt.load is not None:
            with contextlib.suppress(ModelyardError):
                await asyncio.shield(rt.load)
        while True:
            async with self._placing:
                if rt.state is not ModelState.READY:
                    return False
                if not rt.leases and not rt.waiters:  # those waiting take theirs first
                    await self._evict((rt.entry.id,), for_model=None, reason="unload")
                    return True
                changed = self._changed
            await self._wait_for(changed, None)

    # ---- background duties ----------------------------------------------------------------

    def start(self) -> None:
        """Start the keep-alive reaper and the thermal watch (call from the engine's loop)."""
        # Keys of servers that died with an engine killed before this one (keys.py).
        if swept := sweep_stale_keys(self.settings.home):
            log.info("removed %d backend key file(s) left by a stopped engine", swept)
        self._ensure_reaper()
        self._spawn(self._prefetch_estimates(), "estimates")
        self._spawn(self.reach.known(), "reach")  # its warning belongs at start
        if self.settings.thermal.enabled:
            self._spawn(self._watch_thermal(), "thermal")

    async def _prefetch_estimates(self) -> None:
        """Read every known model's estimate now, so a cold load does not wait for it."""
        for entry in self.registry.entries():
            if entry.id not in self._estimates:
                found = await asyncio.to_thread(estimate_model, entry.spec, self.settings)
                self._estimates.setdefault(entry.id, found)

    async def _watch_thermal(self) -> None:
        t = self.settings.thermal
        sensors = ThermalSensors(
            simulated_path=t.simulated_sensors_file,
            gpu_reader=lambda i: self.device.members[i].info().temperature_c,
        )
        cpu = DEFAULT_THRESHOLDS["cpu"].with_overrides(t.cpu_pause_c, t.cpu_resume_c)
        gpu = DEFAULT_THRESHOLDS["nvidia"].with_overrides(t.gpu_pause_c, t.gpu_resume_c)
        has_gpu = self.device.kind != "cpu"
        while True:
            cpu_c = await asyncio.to_thread(sensors.cpu_c)  # psutil reads sysfs: keep it off
            # The hottest GPU of the group decides: a model split over it runs on all of them.
            readings = [(c, i) for i in self.device.indexes
                        if (c := sensors.gpu_c(i)) is not None] if has_gpu else []
            gpu_c, hottest = max(readings, default=(None, self.device.indexes[0]))
            paused, reason = engine_paused(
                self.paused_reason is not None, cpu_c, gpu_c, cpu, gpu, gpu_index=hottest
            )
            self.set_paused(reason if paused else None)
            await asyncio.sleep(t.poll_s)  # a sensor has no event to await

    # ---- keep-alive -----------------------------------------------------------------------

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = self._spawn(self._reap_idle(), "keep-alive")

    async def _reap_idle(self) -> None:
        """Unload models whose keep-alive ran out; sleeps until the next one can expire."""
        while True:
            changed = self._changed  # before reading state: a later change wakes us
            now = self.clock()
            idle = [r for r in self._residents() if not r.busy]
            if scheduler.expired(idle, now):
                async with self._placing:
                    due = scheduler.expired(self._residents(), self.clock())  # still due?
                    for model in due:
                        await self._evict((model,), for_model=None, reason="idle")
                continue
            deadlines = [r.last_used + r.keep_alive_s for r in idle
                         if r.keep_alive_s is not None and not r.pinned]
            self._reaper_wakes_at = min(deadlines, default=math.inf)
            timeout = max(0.0, self._reaper_wakes_at - now) if deadlines else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout)

    # ---- loading and stopping -------------------------------------------------------------

    async def _load(self, rt: Runtime) -> None:
        started = self.clock()
        try:
            if rt.entry.hub is not None and rt.entry.path is not None and not (
                    await asyncio.to_thread(rt.entry.path.exists)):
                await self._pull_here(rt)  # this node lacks the front's file (node_pull.py)
            # A draft is resolved (and a wrong one refused) before anything is evicted for it;
            # its memory then counts with this model's (store/draft.py, store/estimate.py).
            spec = self._paired(rt)
            if rt.entry.id not in self._estimates or spec is not rt.spec:
                found = await asyncio.to_thread(estimate_model, spec, self.settings)
                self._estimates[rt.entry.id] = found
            warm = await self._warm_copy(rt)
            # Before placing: a model that cannot run here must not evict anything. In a thread:
            # a transformers model imports torch here (seconds), and the loop must keep
            # answering the front's heartbeat (front/engines/lease_client.py).
            server: Backend = (warm.backend if warm is not None else
                               await asyncio.to_thread(make_backend, spec, self.settings,
                                                       env=self.env))
            rt.split_sizes = await asyncio.to_thread(self._split_sizes, spec, server)
            await self.reach.known()  # never a GPU its backend cannot use (reach.py)
            rt.cpu_reason = self.reach.reason_for(spec.reach_backend)
            if not await self._place(rt):
                metrics.model_loaded(rt.entry.id, self.index, "cancelled")
                return
            resumed = warm is not None and self.warm.take(rt.entry.id, warm.fingerprint) is warm
            kept: Placement | None = getattr(server, "placement", None)
            if resumed and kept is not None:  # it wakes where it slept
                rt.placement = kept
            if warm is not None and not resumed:  # another load reclaimed it meanwhile
                server = await asyncio.to_thread(make_backend, spec, self.settings, env=self.env)
            if rt.cpu_reason is not None and rt.placement is not None:
                log.info("loading %s on the CPU (%d MiB of host RAM): %s", spec.id,
                         rt.placement.host_bytes // MIB, rt.cpu_reason)
                self._say(rt, f"loading {spec.id} on the CPU "
                              f"({rt.placement.host_bytes / 2**30:.1f} GiB): {rt.cpu_reason}")
            else:
                log.info("loading %s (%d MiB reserved%s)", spec.id, rt.reserved_bytes // MIB,
                         ", from the warm tier" if resumed else "")
                self._say(rt, f"loading {spec.id} ({rt.reserved_bytes / 2**30:.1f} GiB"
                              f"{', warm' if resumed else ''})")
            if resumed:
                assert isinstance(server, Warmable)
                await server.resume()
                if server.pid is not None:
                    self._spawned(rt, server.pid)
            else:
                if rt.placement is not None:  # its devices, before its child starts
                    server.place(rt.placement, self.device.child_env(rt.placement))
                await server.start(on_spawn=lambda pid: self._spawned(rt, pid))
        except ModelLoadFailed as exc:
            rt.state = ModelState.FAILED
            rt.last_error = exc
            rt.cooldown_until = self.clock() + self.settings.load_cooldown_s
            rt.failed_file = file_identity(rt.entry.path)
            exc.retry_after_s = self.settings.load_cooldown_s or None
            self.stats["load_failures"] += 1
            metrics.model_loaded(rt.entry.id, self.index, "failed")
            log.warning("%s", exc.full_message())
            raise
        except BaseException as exc:
            metrics.model_loaded(rt.entry.id, self.index, metrics.load_outcome(exc))
            if rt.state is ModelState.LOADING:
                rt.state = ModelState.STOPPED
            raise
        finally:
            rt.load = None
            rt.read_ahead = False
            self._arrivals.pop(rt.entry.id, None)  # e.g. make_backend refused it
            if rt.state is not ModelState.LOADING:  # it failed, and its child is gone
                rt.pid = rt.measured_bytes = rt.placement = None
            self._notify()
        rt.server = server
        rt.state = ModelState.READY
        rt.last_error = None
        rt.loaded_at = time.time()
        rt.last_used = self.clock()
        rt.load_duration_s = self.clock() - started
        self.stats["loads"] += 1
        if resumed:
            self.stats["warm_loads"] += 1
        metrics.model_loaded(rt.entry.id, self.index, "success", rt.load_duration_s)
        log.info("%s ready on %s in %.2f s", spec.id, server.url, rt.load_duration_s)
        self._say(rt, f"{spec.id} ready in {rt.load_duration_s:.1f} s")
        if not resumed:  # a warm backend's watcher has watched it all along
            self._spawn(self._watch_exit(rt, server), f"watch:{spec.id}")
        if rt.entry.id in self._drafts:
            self._drafts[rt.entry.id].new_server()

    async def _pull_here(self, rt: Runtime) -> None:
        """Pull the model's files onto this node, one pull per hub origin at a time (a context
        variant, a copy and a preset of one model share it), then serve it from there."""
        hub = rt.entry.hub
        assert hub is not None
        async with self._pulls.setdefault(hub, asyncio.Lock()):
            copy = self.catalog.copies.get(hub)
            if copy is None or not await asyncio.to_thread(copy.path.exists):
                copy = await pull_here(rt.entry, self.settings, self.env,
                                       lambda text: self._say(rt, text))
            self.registry = self.catalog.adopt(hub, copy, self.registry)
            rt.entry = served_locally(rt.entry, self.catalog.copies)
            await asyncio.to_thread(self.catalog.refresh, self.registry, self.settings.models_dir)

    def _spawned(self, rt: Runtime, pid: int) -> None:
        rt.pid = pid
        self.device.on_spawn(pid, rt.reserved_bytes, rt.placement)

    async def _watch_exit(self, rt: Runtime, server: Backend) -> None:
        await server.wait_exit()
        self._forget_dead_server(rt, server)
        entry = self.warm.get(rt.entry.id)
        if entry is not None and entry.backend is server:  # it died asleep
            log.warning("%s died in the warm tier", rt.entry.id)
            self.warm.drop(rt.entry.id)
            self._notify()

    def _forget_dead_server(self, rt: Runtime, server: Backend) -> None:
        if rt.server is not server or rt.state is not ModelState.READY:
            return
        # It died on its own: the next request reloads it; streams in flight see the drop.
        log.warning(
            "%s exited unexpectedly; last lines:\n%s",
            rt.entry.id,
            "\n".join(server.tail(self.settings.log_tail_lines)),
        )
        rt.server = None
        rt.pid = rt.measured_bytes = rt.placement = None
        rt.state = ModelState.STOPPED
        rt.restarts += 1
        self.stats["crashes"] += 1
        metrics.model_crashed(rt.entry.id, self.index)
        self._notify()

    async def _stop(self, rt: Runtime, *, warm: bool = False) -> bool:
        """Stop `rt`'s server, or with `warm`, keep it in the warm tier if it can be: True
        when it went there."""
        server = rt.server
        if server is None:
            rt.state = ModelState.STOPPED
            return False
        rt.state = ModelState.STOPPING
        rt.server = None
        try:
            if warm and await self._suspend(rt, server):
                return True
            await server.stop()
        finally:
            rt.state = ModelState.STOPPED
            rt.pid = rt.measured_bytes = rt.placement = None
        return False

    async def shutdown(self) -> None:
        for rt in self._models.values():
            if rt.load is not None:
                rt.load.cancel()
        warm = [e.backend for e in self.warm if self.warm.drop(e.model) is not None]
        await asyncio.gather(*(self._stop(rt) for rt in self._models.values()),
                             *(backend.stop() for backend in warm))
        for task in list(self._tasks):
            task.cancel()

    # ---- the draft of speculative decoding ------------------------------------------------

    def _paired(self, rt: Runtime) -> ModelSpec:
        """`rt`'s spec with its speculative-decoding draft resolved to a file, and its draft
        counts kept from now on (a transformers model's say why it runs without its draft)."""
        spec = rt.spec
        draft = getattr(spec, "draft_model", None)
        if draft is None:
            self._drafts.pop(rt.entry.id, None)
            return spec
        off = TRANSFORMERS_OFF if isinstance(spec, TransformersModel) else None
        resolved = with_draft_path(spec, self.registry, self.settings)
        counts = self._drafts.get(rt.entry.id)
        if counts is None or counts.draft_model != draft:
            self._drafts[rt.entry.id] = DraftCounts(rt.entry.id, draft, off)
        return resolved




