"""The engine's reports: its status for /status and `modelyard ps`, its models' records (which
placement reads too: placement/view.py builds the policy's view from them), and diagnostics.

One part of the `Engine` (engine/loop.py; its state: engine/state.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from modelyard.engine.backends.base import Backend
from modelyard.engine.ledger import host_memory
from modelyard.engine.runtime import ModelState, Runtime
from modelyard.engine.state import EngineState
from modelyard.hw.devices import describe_devices
from modelyard.wire.status import (
    DeviceStatus,
    EngineStatus,
    ModelMemory,
    ModelStatus,
    SchedulerStatus,
)


class Reports(EngineState):
    def _host_status(self) -> DeviceStatus | None:
        """Host RAM as a partial offload's room: what is available, less the host part of the
        offloads placed (the host ledger: llama.cpp maps a GGUF's CPU layers from the file,
        and the kernel counts mapped file pages as available, so what an offload keeps in
        host RAM must be counted here, not left to the reading); None on the CPU engine,
        whose device is host RAM already."""
        if self.device.kind == "cpu":
            return None
        free, total = host_memory()
        pending = sum(r.placement.host_bytes for r in self._models.values()
                      if r.state in (ModelState.LOADING, ModelState.READY)
                      and r.placement is not None)
        return DeviceStatus(kind="host", name="host RAM", index=-1, total_bytes=total,
                            free_bytes=max(0, free - pending))

    def status(self) -> EngineStatus:
        self._measure()
        info = self.device.info()
        return EngineStatus(
            engine=self.index,
            pid=os.getpid(),
            started_at=self.started_at,
            device=DeviceStatus(
                kind=info.kind,
                name=info.name,
                total_bytes=info.total_bytes,
                used_bytes=info.used_bytes,
                free_bytes=info.free_bytes,
                temperature_c=info.temperature_c,
                utilization_pct=info.utilization_pct,
                reserved_loading_bytes=sum(
                    rt.reserved_bytes for rt in self._models.values()
                    if rt.state is ModelState.LOADING
                ),
                warm_bytes=self.warm.device_bytes,
            ),
            paused=self.paused_reason,
            scheduler=SchedulerStatus(
                max_loaded_models=self._max_loaded(),
                counters=dict(self.stats),
                recent_swaps=tuple(self.swaps),
                placing=tuple(self._arrivals),
            ),
            models=self.model_statuses(),
            devices=self._device_statuses(),
            host=self._host_status(),
            storage_id=self.catalog.storage_id,
            missing_files=self.catalog.missing,
            cpu_backends=self.reach.cpu_backends(),
            gpu_warning=self.reach.warning,
        )

    def _device_statuses(self) -> tuple[DeviceStatus, ...]:
        """One record per device of the group, by physical index: what the front plans a
        placement with, and what `modelyard ps` shows per device."""
        promised: dict[int, int] = {}
        for rt in self._models.values():
            if rt.state is ModelState.LOADING and rt.placement is not None:
                for d, n in rt.placement.device_bytes:
                    promised[d] = promised.get(d, 0) + n
        return tuple(
            DeviceStatus(index=i.index, kind=i.kind, name=i.name, total_bytes=i.total_bytes,
                         used_bytes=i.used_bytes, free_bytes=i.free_bytes,
                         temperature_c=i.temperature_c, utilization_pct=i.utilization_pct,
                         reserved_loading_bytes=promised.get(i.index, 0))
            for i in self.device.infos())

    def diag(self) -> dict[str, Any]:
        return {
            "engine": self.index,
            "device": dataclasses.asdict(self.device.info()),
            "devices": describe_devices(),
            # Which backends can use its GPUs (engine/reach.py): what a doctor shows.
            "backend_reach": self.reach.to_json(),
        }

    def model_statuses(self) -> tuple[ModelStatus, ...]:
        now = self.clock()
        return tuple(self.warm.report(self._model_status(rt, now))
                     for rt in self._models.values())

    def backend_key(self, model_id: str) -> str | None:
        """The key of `model_id`'s server, for the engine's own calls to it (slot save and
        restore); None when it runs none or takes no key."""
        rt = self._models.get(model_id)
        return rt.server.api_key if rt is not None and rt.server is not None else None

    def model_status(self) -> list[dict[str, Any]]:
        """`model_statuses()` as the engine's /status carries them."""
        return [m.to_json() for m in self.model_statuses()]

    def _model_status(self, rt: Runtime, now: float, *, report: bool = True) -> ModelStatus:
        """`rt` as reported; without `report`, only what placement reads (no estimate, backend
        stats or host memory: those cost a walk of the process tree or a lock)."""
        server = rt.server
        keep_alive = self._keep_alive(rt)
        idle = rt.state is ModelState.READY and not rt.leases
        placed = server is not None or rt.load is not None
        estimate = self._estimates.get(rt.entry.id) if report else None
        return ModelStatus(
            model=rt.entry.id,
            backend=rt.spec.backend,
            state=str(rt.state),
            pid=server.pid if server else None,
            upstream=server.url if server else None,
            leases=len(rt.leases),
            loaded_at=rt.loaded_at if server else None,
            load_duration_s=rt.load_duration_s,
            size_bytes=rt.entry.size_bytes,
            pinned=self._pinned(rt),
            last_used=rt.last_used,
            priority=rt.spec.priority,
            group=rt.spec.group,
            keep_alive_s=keep_alive,
            expires_in_s=(
                max(0.0, rt.last_used + keep_alive - now)
                if idle and keep_alive is not None else None
            ),
            waiting_for_memory_s=(
                now - rt.waiting_since if rt.waiting_since is not None else None
            ),
            memory=ModelMemory(
                estimate_bytes=estimate.total_bytes if estimate else None,
                estimate=estimate.to_json() if estimate else None,
                reserved_bytes=rt.reserved_bytes if placed else None,
                # While loading too: the ledger counts what it holds already (plannable_free).
                measured_bytes=rt.measured_bytes if placed else None,
                host_bytes=server.memory_bytes() if server and report else None,
                load_bytes=self._want_bytes(rt),
            ),
            # What the backend says of itself (batching, prefix-cache hit rate…).
            backend_stats=_backend_stats(server) if report else None,
            restarts=rt.restarts,
            last_error=rt.last_error.message if rt.last_error else None,
            cooldown_s=max(0.0, rt.cooldown_until - now) or None,
            coexist_with=tuple(rt.spec.can_coexist_with),
            waiters=rt.waiters,
            speculative=(self._drafts[rt.entry.id].status()
                         if rt.entry.id in self._drafts else None),
            placement=rt.placement if placed else None,
            cpu_reason=rt.cpu_reason if placed else None,
        )


def _backend_stats(server: Backend | None) -> dict[str, Any] | None:
    stats = getattr(server, "stats", None)
    return stats() if callable(stats) else None
