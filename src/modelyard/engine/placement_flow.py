"""The engine's placement: it asks the pure policy (placement/policy.py) what to do for a load,
from the same records it reports, and applies the decision: evicting, waiting for memory in
arrival order, reserving what the load was promised (the rules: engine/loop.py's docstring).

One part of the `Engine` (engine/loop.py; its state: engine/state.py). Placement decisions are
taken one at a time under `_placing`; the loads themselves run side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from modelyard import metrics
from modelyard.config import LlamaCppModel, ModelSpec, ServiceModel, TransformersModel
from modelyard.engine.backends.base import Backend
from modelyard.engine.backends.openai_server import ChildServer
from modelyard.engine.read_ahead import read_ahead
from modelyard.engine.reports import Reports
from modelyard.engine.runtime import ModelState, Runtime
from modelyard.engine.warm_flow import WarmFlow
from modelyard.errors import InsufficientMemory
from modelyard.placement import policy as scheduler
from modelyard.placement import view as placement
from modelyard.placement.devices import LayerProfile, Placement
from modelyard.placement.tensor_parallel import tensor_parallel_sizes
from modelyard.store.attention import attention_heads
from modelyard.store.registry import served_name
from modelyard.wire.status import DeviceStatus, EngineStatus, ModelStatus, SchedulerStatus, Swap

log = logging.getLogger("modelyard.engine")


class PlacementFlow(Reports, WarmFlow):
    def _placed(self, exclude: Runtime | None = None) -> tuple[ModelStatus, ...]:
        """What the policy reads of each loaded or loading model: the same records the
        engine reports (less the report-only figures), so the front's prediction from /status
        and the engine's decision come from one builder (placement/view.py)."""
        now = self.clock()
        return tuple(
            self._model_status(rt, now, report=False)
            for rt in self._models.values()
            if rt is not exclude and rt.state in (ModelState.READY, ModelState.LOADING)
        )

    def _residents(self, exclude: Runtime | None = None) -> list[scheduler.Resident]:
        return placement.residents(self._placed(exclude))

    def _profile(self, rt: Runtime) -> LayerProfile | None:
        """The model's memory by layer, to split it by layers or offload some (store/estimate.py
        `estimate_profile`: it rides on the estimate); None: placed by its total bytes. The
        policy scales it to the bytes it places (a measured load)."""
        found = self._estimates.get(rt.entry.id)
        return found.profile if found is not None else None

    def _split_sizes(self, spec: ModelSpec, server: Backend) -> frozenset[int] | None:
        """A safetensors model that runs as a child server is vLLM (engine/backends/base.py
        `vllm_spec`): its tensor-parallel size must divide its attention heads, so the policy
        only considers such device counts. Other backends split by layers: any count."""
        if isinstance(spec, TransformersModel) and isinstance(server, ChildServer):
            return tensor_parallel_sizes(attention_heads(spec.path), len(self.device.infos()))
        return None

    def _decide(self, rt: Runtime) -> scheduler.Decision:
        self._measure()
        infos = self.device.infos()
        info = self.device.info()
        spec = rt.spec
        want = scheduler.Want(
            model=rt.entry.id,
            bytes=self._want_bytes(rt),
            group=spec.group,
            coexist_with=frozenset(spec.can_coexist_with),
            priority=spec.priority,
            avoid_devices=sibling_devices(rt.entry.id, self._placed(exclude=rt)),
            profile=self._profile(rt),
            offload=getattr(spec, "offload", "off") == "auto",
            # A registered service is one process on one device: never split.
            splittable=not isinstance(spec, ServiceModel),
            split_sizes=rt.split_sizes,
            backend=spec.reach_backend,
            cpu_reason=rt.cpu_reason,  # its backend cannot use the GPUs: host RAM (reach.py)
        )
        # The engine's own view, in the shape it reports: the front plans on /status the same way.
        view = EngineStatus(
            device=DeviceStatus(total_bytes=info.total_bytes, free_bytes=info.free_bytes,
                                warm_bytes=self.warm.device_bytes),
            devices=tuple(DeviceStatus(index=i.index, kind=i.kind, total_bytes=i.total_bytes,
                                       free_bytes=i.free_bytes) for i in infos),
            host=self._host_status(),
            scheduler=SchedulerStatus(max_loaded_models=self._max_loaded(),
                                      placing=tuple(self._arrivals)),
            models=self._placed(exclude=rt),
            cpu_backends=self.reach.cpu_backends(),
        )
        return placement.plan_from_status(view, want)

    async def _place(self, rt: Runtime) -> bool:
        """Make room for `rt` and reserve it: True with rt LOADING; False when nobody waits for
        it any more (every client left), before anything was evicted for it; or raises.

        An eviction and the load it made room for are one decision under `_placing`: a later
        load cannot take the room in between. Loads that must wait keep their place in
        `_arrivals`, so they are placed in the order they began."""
        deadline = self.clock() + self.settings.memory_wait_timeout_s
        if self._placing.locked() or next(iter(self._arrivals), rt.entry.id) != rt.entry.id:
            self._read_ahead(rt)  # it waits behind another load's placement
        try:
            while True:
                async with self._placing:
                    while True:
                        if not rt.waiters:
                            log.info("nobody waits for %s any more: its load is dropped",
                                     rt.entry.id)
                            rt.waiting_since = None
                            return False
                        decision = self._decide(rt)
                        if not isinstance(decision, scheduler.Evict):
                            break
                        self._read_ahead(rt)  # while the victims stop
                        await self._evict(decision.victims, for_model=rt.entry.id)
                    if isinstance(decision, scheduler.Load):
                        await self._reclaim_warm(rt)
                        rt.placement = self._placement_of(decision, self._want_bytes(rt))
                        # What the devices were promised: a partial offload's host part is
                        # counted in the host ledger (`_host_status`), not on a device.
                        rt.reserved_bytes = rt.placement.bytes
                        rt.measured_bytes = None
                        rt.measured_by_device = {}
                        rt.state = ModelState.LOADING
                        rt.waiting_since = None
                        return True
                    if isinstance(decision, scheduler.NoFit):
                        self.stats["no_fit"] += 1
                        raise InsufficientMemory(decision.reason, model=rt.entry.id)
                    assert isinstance(decision, scheduler.Wait), decision
                    changed = self._changed  # taken under the lock: no change can be missed
                self._read_ahead(rt)  # while it waits for memory
                if rt.waiting_since is None:
                    rt.waiting_since = self.clock()
                    self.stats["waits"] += 1
                    log.info("%s", decision.reason)
                    self._say(rt, decision.reason)
                remaining = deadline - self.clock()
                if remaining <= 0:
                    rt.waiting_since = None
                    raise InsufficientMemory(
                        f"{decision.reason}; gave up after memory_wait_timeout_s "
                        f"({self.settings.memory_wait_timeout_s:.0f} s)",
                        model=rt.entry.id,
                        retry_after_s=5.0,
                    )
                with contextlib.suppress(TimeoutError):
                    await self._wait_for(changed, remaining)
        finally:
            # Placed, dropped or failed: the loads behind it may go now.
            if rt.entry.id in self._arrivals:
                del self._arrivals[rt.entry.id]
                self._notify()

    async def _evict(
        self, victims: tuple[str, ...], *, for_model: str | None, reason: str = "unload"
    ) -> None:
        """Unload idle `victims` (caller holds `_placing`) and wait for their memory."""
        runtimes = [self._models[v] for v in victims]
        for rt in runtimes:  # before any await: no lease can be granted on them from here on
            assert not rt.leases, f"policy chose busy {rt.entry.id}"
            rt.state = ModelState.STOPPING
        self._measure()
        # Per device: models loading meanwhile (loads run outside `_placing`) go on claiming
        # what they were promised: counting it as free here would wait for memory that never
        # comes back.
        before = {r.index: r.free_bytes for r in self.device.rooms(self._loading_held())}
        # Only memory the device showed them holding can be waited for: a service's unload
        # route is trusted once it answered. A victim spanning several devices frees each.
        freed: dict[int, int] = {}
        for rt in runtimes:
            if rt.pid is not None:
                for d, n in rt.measured_by_device.items():
                    freed[d] = freed.get(d, 0) + n
        victim_pids = [rt.pid for rt in runtimes]
        pids = {pid for pid in victim_pids if pid is not None}
        reason = f"for {for_model}" if for_model else reason
        for rt in runtimes:
            self._record_swap(rt, reason)
            metrics.model_evicted(rt.entry.id, self.index, reason, for_model)
        if for_model is not None:
            names = ", ".join(victims)
            self._say(self._models[for_model], f"unloading {names} to make room for {for_model}")
        # A reload changed the spec: the old copy is worth nothing warm.
        warm = await asyncio.gather(*(self._stop(rt, warm=reason != "reload") for rt in runtimes))
        asleep = {pid for pid, kept in zip(victim_pids, warm, strict=True) if kept and pid}
        if asleep:  # a sleeping server lives on, holding a little: wait for the rest only
            pids -= asleep
            for d, held in self.device.used_by_device(asleep).items():
                freed[d] = max(0, freed.get(d, 0) - sum(held.values()))
        # Expect most of it back: allocators and drivers keep a little. Host RAM has no driver
        # that frees it late, and every other process on the host moves its free figure: there,
        # the processes being gone is the memory being back.
        want = {} if self.device.kind == "cpu" else {
            d: before.get(d, 0) + int(n * 0.9) for d, n in freed.items() if n}
        await self.device.wait_for_recovery(pids, want, self.settings.memory_recovery_timeout_s)
        self._notify()

    def _placement_of(self, decision: scheduler.Load, nbytes: int) -> Placement:
        """Where the decision puts the load (a policy without device sets: all of it on the
        group's first device)."""
        placed = decision.placement
        return placed if placed is not None else Placement.whole(self.device.indexes[0], nbytes)

    def _loading_held(self) -> dict[int, int]:
        """Per device, what loads in progress were promised and the device does not show them
        holding yet (placement/ledger.py `plannable_free`, device by device)."""
        held: dict[int, int] = {}
        for r in self._models.values():
            if r.state is not ModelState.LOADING:
                continue
            promised = (r.placement.device_bytes if r.placement is not None
                        else ((self.device.indexes[0], r.reserved_bytes),))
            for d, n in promised:
                held[d] = held.get(d, 0) + max(0, n - r.measured_by_device.get(d, 0))
        return held

    def _record_swap(self, rt: Runtime, reason: str) -> None:
        kind = {"idle": "expirations", "unload": "unloads", "reload": "unloads"}.get(
            reason, "evictions")
        self.stats[kind] += 1
        self.swaps.append(
            Swap(time.time(), rt.entry.id, reason, rt.measured_bytes or rt.reserved_bytes)
        )
        log.info("unloading %s (%s)", rt.entry.id, reason)

    def _read_ahead(self, rt: Runtime) -> None:
        """A request waits for cold GGUF `rt`: read its files into the page cache meanwhile
        (once per load), so llama-server maps them from memory (engine/read_ahead.py)."""
        spec = rt.spec
        if rt.read_ahead or not self.settings.gguf_read_ahead or not isinstance(
                spec, LlamaCppModel):
            return
        rt.read_ahead = True
        log.info("%s waits: reading its file ahead into the page cache", spec.id)
        paths = [spec.path] + ([spec.mmproj] if spec.mmproj is not None else [])
        self._spawn(asyncio.to_thread(read_ahead, paths, self._fadvise), f"read-ahead:{spec.id}")


def sibling_devices(model: str, placed: Sequence[ModelStatus]) -> frozenset[int]:
    """The devices holding other copies of `model` (`<model>#<k>`, front/dispatch/replicas.py):
    a copy rather goes elsewhere, so that the copies of a hot model compute side by side."""
    family = served_name(model)
    return frozenset(
        device for m in placed
        if m.model != model and m.placement is not None and served_name(m.model) == family
        for device in m.placement.devices
    )
