"""The engine's state and the primitives every part of it uses (engine/loop.py).

The `Engine` is assembled from one class per concept (loop.py: leases, loading, the reaper;
placement_flow.py; warm_flow.py; reports.py; reload_flow.py), all sharing this state: it is
mutated only from the engine's event loop, so there is one owner (DESIGN.md §3.1) and the parts
need no locks or hand-offs between them; splitting the state itself across objects would only
add references between them.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from modelyard import metrics
from modelyard.config import ServiceModel, Settings
from modelyard.engine.device_group import DeviceGroup, make_device
from modelyard.engine.ledger import Device, HostDevice
from modelyard.engine.node_pull import Hub
from modelyard.engine.pushed_catalog import PushedCatalog, catalog_pushed
from modelyard.engine.reach import BackendReach
from modelyard.engine.read_ahead import Fadvise
from modelyard.engine.runtime import ModelState, Runtime
from modelyard.engine.speculative import DraftCounts
from modelyard.engine.warm_tier import WarmTier
from modelyard.placement.devices import Placement
from modelyard.store.estimate import MemoryEstimate, serving_bytes
from modelyard.store.registry import ModelRegistry
from modelyard.wire.status import Swap

log = logging.getLogger("modelyard.engine")

MIB = 2**20
# Swaps remembered for /status and `modelyard ps`.
RECENT_SWAPS = 50


class EngineState:
    def __init__(
        self,
        settings: Settings,
        registry: ModelRegistry,
        *,
        index: int = 0,
        env: Mapping[str, str] | None = None,
        device: Device | None = None,
        clock: Callable[[], float] = time.monotonic,
        fadvise: Fadvise | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.index = index
        self.clock = clock
        self._models: dict[str, Runtime] = {}
        self._leases: dict[str, str] = {}
        # Told the model's id when a request has to wait for one of its slots (the lease
        # channel's Wanted frames: a front then stops keeping that model's leases).
        self.slot_wanted: set[Callable[[str], None]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._placing = asyncio.Lock()
        self._changed = asyncio.Event()  # replaced on every change; waiters re-plan
        self._waiters = 0  # loads and unloads waiting for a change
        self._estimates: dict[str, MemoryEstimate | None] = {}  # read ahead of cold loads
        self._arrivals: dict[str, None] = {}  # loads not placed yet, in the order they began
        self._reaper_wakes_at = math.inf  # when the keep-alive reaper looks next
        self._cool = asyncio.Event()
        self._cool.set()
        self.paused_reason: str | None = None
        # The devices it owns (config `engine_devices`): a group of one or several.
        self.device = (DeviceGroup.of(device) if device is not None
                       else make_device(settings, index, self._child_pids))
        self.warm = WarmTier(settings.warm_tier_bytes, clock)
        self._fadvise = fadvise  # the GGUF read-ahead's seam (None: os.posix_fadvise)
        host = self.device.first
        if isinstance(host, HostDevice):  # warm models hold the CPU engine's device
            host.held_elsewhere = lambda: self.warm.device_bytes
        self.env = {**(env if env is not None else os.environ), **self.device.child_env()}
        # Which backends can use its GPUs, asked once before the first placement (reach.py).
        kind = self.device.kind
        self.reach = BackendReach(settings, kind, 0 if kind == "cpu" else len(self.device.indexes),
                                  index, on_known=self._notify)
        metrics.child_env(self.env)  # a backend keeps its own metrics out of ours
        self.stats: collections.Counter[str] = collections.Counter()
        self.swaps: collections.deque[Swap] = collections.deque(maxlen=RECENT_SWAPS)
        self.started_at = time.time()
        self._reaper: asyncio.Task[None] | None = None
        self._drafts: dict[str, DraftCounts] = {}  # speculative decoding, by model id
        # What the front pushed of its catalog (engine/pushed_catalog.py).
        self.catalog = PushedCatalog(catalog_pushed(settings, env))
        self._pulls: dict[Hub, asyncio.Lock] = {}  # pulls onto this node, one per model

    def _say(self, rt: Runtime, text: str) -> None:
        for listener in list(rt.listeners):
            listener(text)

    async def _wait_for(self, changed: asyncio.Event, timeout: float | None) -> None:
        """Wait for a change, counted, so releases know someone needs waking."""
        self._waiters += 1
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        finally:
            self._waiters -= 1

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _want_bytes(self, rt: Runtime) -> int:
        return serving_bytes(rt.spec, self._estimates.get(rt.entry.id),
                             measured=rt.known_bytes, file_bytes=rt.entry.size_bytes)

    def _keep_alive(self, rt: Runtime) -> float | None:
        if rt.spec.pinned:
            return None
        value = rt.keep_alive_s
        if value is None:
            value = rt.spec.keep_alive_s
        if value is None:
            value = self.settings.keep_alive_s
        return None if value < 0 else value

    def _measure(self) -> None:
        """Refresh what each loading or loaded model holds on each device."""
        pids = {rt.pid: rt for rt in self._models.values() if rt.pid is not None}
        by_device = self.device.used_by_device(pids)
        for pid, rt in pids.items():
            rt.measured_by_device = {d: held[pid] for d, held in by_device.items() if pid in held}
            rt.measured_bytes = sum(rt.measured_by_device.values()) if rt.measured_by_device \
                else None
            if rt.state is ModelState.READY and rt.measured_bytes:
                rt.placement = measured_placement(rt.placement, rt.measured_by_device)
                # A partial offload's host part is no device's: the next load needs it too.
                host = rt.placement.host_bytes if rt.placement is not None else 0
                rt.known_bytes = rt.measured_bytes + host

    @staticmethod
    def _pinned(rt: Runtime) -> bool:
        """Never evicted nor expired: pinned, or a service that manages itself or has no
        unload route."""
        spec = rt.spec
        self_managed = isinstance(spec, ServiceModel) and spec.self_managed
        cannot_unload = isinstance(spec, ServiceModel) and spec.unload_path is None
        return spec.pinned or self_managed or cannot_unload

    def _max_loaded(self) -> int | None:
        spec = self.settings.engine_specs.get(self.index)
        if spec is not None and spec.max_loaded_models is not None:
            return spec.max_loaded_models
        return self.settings.max_loaded_models

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        # Load failures are reported to every waiter; retrieving here keeps asyncio quiet
        # when all of them have gone.
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and task.get_name() in ("keep-alive", "thermal"):
            log.error("%s task failed", task.get_name(), exc_info=exc)

    def _child_pids(self) -> list[int]:
        return [rt.server.pid for rt in self._models.values()
                if rt.server is not None and rt.server.pid is not None]

    if TYPE_CHECKING:  # defined in engine/loop.py, called from the parts defined before it
        async def _stop(self, rt: Runtime, *, warm: bool = False) -> bool: ...

        async def _prefetch_estimates(self) -> None: ...


def measured_placement(placed: Placement | None, measured: Mapping[int, int]) -> Placement | None:
    """`placed` with the bytes the devices show on each of its devices instead of the
    estimate's (the next plan and the report read what is true); its host bytes and layers
    stay as they were placed."""
    if placed is None or not measured:
        return placed
    return dataclasses.replace(placed, device_bytes=tuple(
        (d, measured.get(d, n)) for d, n in placed.device_bytes))
