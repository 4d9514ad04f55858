"""The engine's config reload: it takes up a new configuration while it serves, stopping the
models whose spec changed or went once their requests in flight are done.

One part of the `Engine` (engine/loop.py; its state: engine/state.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from modelyard.config import Settings
from modelyard.engine.placement_flow import PlacementFlow
from modelyard.engine.runtime import ModelState, Runtime
from modelyard.engine.warm_tier import fingerprint
from modelyard.store.config_diff import diff_specs, keep_running, spec_views
from modelyard.store.registry import Entry

log = logging.getLogger("modelyard.engine")


class ConfigReload(PlacementFlow):
    async def reload(self, settings: Settings) -> dict[str, Any]:
        """Take up a new configuration. A model whose spec changed (or that is gone) stops once
        its requests in flight are done, and the next request loads the new spec; the others
        keep running. Settings that need a restart keep their running values."""
        settings = keep_running(settings, self.settings)
        registry = await asyncio.to_thread(self.catalog.build, settings)
        running = list(self._models)  # context variants among them are compared too
        diff = diff_specs(spec_views(self.registry, self.settings, running),
                          spec_views(registry, settings, running))
        self.settings, self.registry = settings, registry
        self.reach.update(settings)  # another llama-server: asked again before its next load
        restarting = []
        for rt in list(self._models.values()):
            model_id = rt.entry.id
            entry = registry.get(model_id) if model_id not in diff.removed else None
            if model_id not in diff.restart:
                if rt.retiring is not None:
                    rt.retire_to = entry
                elif entry is not None:  # the same server; new aliases, priority, keep-alive…
                    rt.entry = entry
                continue
            self._estimates.pop(model_id, None)
            rt.known_bytes = None
            rt.cooldown_until, rt.last_error = 0.0, None  # a new spec deserves a new try
            if rt.retiring is not None:
                rt.retire_to = entry
            elif rt.state in (ModelState.STOPPED, ModelState.FAILED) and rt.load is None:
                self._retarget(rt, entry)
            else:
                rt.retire_to = entry
                rt.retiring = self._spawn(self._retire(rt), f"retire:{model_id}")
            restarting.append(model_id)
        # Warm copies of a spec that changed or went are stale; a smaller budget drops some.
        stale = [self.warm.drop(e.model) for e in self.warm
                 if (entry := registry.get(e.model)) is None
                 or e.fingerprint != fingerprint(entry.spec)]
        dropped = [e for e in stale if e is not None] + self.warm.resize(settings.warm_tier_bytes)
        self._spawn(self._drop_warm(dropped), "warm-drop")
        self._spawn(self._prefetch_estimates(), "estimates")
        self._notify()
        log.info("config reloaded: %s", diff.to_json())
        return {**diff.to_json(), "restarting": sorted(restarting)}

    def _retarget(self, rt: Runtime, entry: Entry | None) -> None:
        """Give an idle runtime its new entry; None forgets it."""
        if entry is not None:
            rt.entry = entry
        elif self._models.get(rt.entry.id) is rt:
            del self._models[rt.entry.id]

    async def _retire(self, rt: Runtime) -> None:
        """Stop `rt`'s server once its leases are released (a reload changed or removed its
        spec), as `unload` does; requests that arrive meanwhile wait for it, then load anew."""
        try:
            if rt.load is not None:
                with contextlib.suppress(Exception):  # its waiters hear how it failed
                    await asyncio.shield(rt.load)
            while True:
                async with self._placing:
                    if rt.state is not ModelState.READY:
                        break  # it failed, crashed or was evicted meanwhile
                    if not rt.leases:
                        await self._evict((rt.entry.id,), for_model=None, reason="reload")
                        break
                    changed = self._changed
                await self._wait_for(changed, None)
        finally:
            rt.retiring = None
            self._retarget(rt, rt.retire_to)
            rt.retire_to = None
            self._notify()
