"""The engine's warm-tier glue: it suspends evicted backends into the warm tier, takes them
back for a load, and stops those the tier lets go (engine/warm_tier.py is the bookkeeping).

One part of the `Engine` (engine/loop.py; its state: engine/state.py).
"""

from __future__ import annotations

import asyncio
import logging

from modelyard.engine.backends.base import Backend
from modelyard.engine.ledger import host_memory, wait_for_recovery
from modelyard.engine.runtime import ModelState, Runtime
from modelyard.engine.state import MIB, EngineState
from modelyard.engine.warm_tier import Warmable, WarmEntry, fingerprint
from modelyard.placement.ledger import Loading, plannable_free

log = logging.getLogger("modelyard.engine")


class WarmFlow(EngineState):
    async def _suspend(self, rt: Runtime, server: Backend) -> bool:
        """Put `server` in the warm tier instead of stopping it, if it can go and host RAM
        allows; older warm models make room by the tier's LRU."""
        if not isinstance(server, Warmable) or self.warm.budget_bytes <= 0:
            return False
        host = server.warm_bytes()
        # On a CPU engine an in-process model stays where it is: nothing moves into host RAM.
        in_place = self.device.kind == "cpu" and server.pid is None
        free, total = host_memory()
        if not self.warm.admits(host, new_host_bytes=0 if in_place else host,
                                host_free=free, host_total=total):
            return False
        pid = server.pid
        try:
            kept = await server.suspend()
        except Exception:
            log.exception("%s could not be suspended: stopping it", rt.entry.id)
            kept = False
        if not kept:
            return False
        held = self.device.used_by((pid,)).get(pid, 0) if pid is not None else 0
        entry = WarmEntry(
            model=rt.entry.id, fingerprint=fingerprint(rt.spec), backend=server, host_bytes=host,
            device_bytes=host if in_place else held, how="host" if pid is None else "asleep",
            since=self.clock(),
        )
        log.info("%s kept warm (%d MiB of host RAM)", rt.entry.id, host // MIB)
        await self._drop_warm(self.warm.admit(entry))
        return True

    async def _warm_copy(self, rt: Runtime) -> WarmEntry | None:
        """`rt`'s warm entry if it is the spec asked for; a stale one is dropped."""
        entry = self.warm.get(rt.entry.id)
        if entry is None or entry.fingerprint == fingerprint(rt.spec):
            return entry
        self.warm.drop(rt.entry.id)
        await self._drop_warm([entry])
        return None

    async def _reclaim_warm(self, rt: Runtime) -> None:
        """Stop the warm models whose device memory `rt`'s load needs (placement counted it as
        free); `rt`'s own warm copy is what it loads from."""
        if not self.warm.device_bytes:
            return
        info = self.device.info()
        free = plannable_free(info.free_bytes or 0, [
            Loading(r.reserved_bytes, r.measured_bytes or 0)
            for r in self._models.values() if r.state is ModelState.LOADING
        ])
        own = self.warm.get(rt.entry.id)
        need = self._want_bytes(rt) - free - (own.device_bytes if own is not None else 0)
        if need > 0:
            await self._drop_warm(self.warm.reclaim(need, keep=rt.entry.id))

    async def _drop_warm(self, entries: list[WarmEntry]) -> None:
        """Stop warm models the tier let go, and wait for their processes' memory."""
        if not entries:
            return
        pids = {e.backend.pid for e in entries if e.backend.pid is not None}
        for e in entries:
            log.info("%s leaves the warm tier", e.model)
        await asyncio.gather(*(e.backend.stop() for e in entries))
        if pids:
            await wait_for_recovery(self.device, pids, 0, self.settings.memory_recovery_timeout_s)
        self._notify()
