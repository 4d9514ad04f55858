"""Startup models and pinned copies are loaded again when their engine leaves (issue 20).

`startup_models` and the `replicas: N` copies are what an operator expects to find loaded. When
the engine holding one is removed from the provider's view (a node left the cluster, an engine
process was removed), or stays down longer than a restart takes, the model is loaded on another
engine that can take it — chosen by routing, like the startup's own load — so the cluster keeps
serving it warm, and N copies stay N.

Why "down longer than a restart": a crashed engine process is restarted by its supervisor after
`engine_restart_backoff_s` and a few seconds of start; moving its models at once would load a
second copy elsewhere for a blip. Past `engine_restart_backoff_s + DOWN_GRACE_S` it is wedged,
being killed, or its node is gone. An engine that comes back within the grace is a new process
without its models (or one that was silent and still has them: the load is then a no-op), so its
models are loaded again too, wherever routing says (usually on it again).

A model pinned to an engine (`engine: K`) is never moved: a pin is a hard constraint (routing
refuses it elsewhere too); it is loaded again when its engine is back up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from modelyard.errors import ModelyardError

if TYPE_CHECKING:
    from modelyard.front.catalog import Catalog
    from modelyard.front.dispatch.dispatcher import Dispatcher
    from modelyard.wire.engines import EngineClient

log = logging.getLogger("modelyard.front.replace")

DOWN_GRACE_S = 10.0  # beyond the restart backoff: an engine start's few seconds, with room
TICK_S = 1.0  # how often "down for how long" is checked between views (no I/O: a dict scan)
RETRY_S = 30.0  # a model that could not be loaded anywhere is tried again this much later


class Replacer:
    """Where each startup model was loaded, and the task that loads it again elsewhere."""

    def __init__(self, dispatch: Dispatcher, catalog: Catalog, *,
                 clock: Callable[[], float] | None = None) -> None:
        self.dispatch = dispatch
        self.catalog = catalog
        self._clock = clock  # the loop's time unless a test gives one
        self.placed: dict[str, str] = {}  # startup model id → engine it was loaded on
        self._down_since: dict[str, float] = {}  # engine → loop time it was first seen down
        self._retry_at: dict[str, float] = {}  # model → loop time of its next try
        self._seen: dict[str, EngineClient] = {}  # engine → its client when last seen
        self._task: asyncio.Task[None] | None = None

    def _now(self) -> float:
        return (self._clock or asyncio.get_running_loop().time)()

    async def load_startup(self) -> None:
        """`startup_models` are loaded before the server reports ready; a failure is logged,
        not fatal (the model will say why on its first request)."""
        for name in self.catalog.settings.startup_models:
            try:
                entry = self.catalog.registry.resolve(name)
                engine = await self._load(entry.id)
                log.info("startup model %s loaded on %s", entry.id, engine)
            except ModelyardError as exc:
                log.error("startup model %s not loaded: %s", name, exc.full_message())

    async def _load(self, model: str) -> str:
        entry = self.catalog.registry.resolve(model)
        engine = await self.dispatch.route(entry)
        await engine.load(entry.id)
        self.placed[entry.id] = engine.name
        return engine.name

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="replace-models")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _follow(self) -> None:
        provider = self.dispatch.provider
        version = provider.view.version
        while True:
            with contextlib.suppress(TimeoutError):
                version = (await asyncio.wait_for(provider.changed(version), TICK_S)).version
            try:
                await self.check()
            except Exception:  # never let one bad pass end the watch
                log.exception("re-placing models failed")

    def lost(self) -> dict[str, str]:
        """Startup models and pinned copies whose engine is gone or down past the grace, or
        back up after being down (a new process): model → the engine it was on."""
        now = self._now()
        view = self.dispatch.provider.view
        grace = float(self.catalog.settings.engine_restart_backoff_s) + DOWN_GRACE_S
        came_back: set[str] = set()
        for engine in view.engines:
            if self._seen.get(engine.name, engine) is not engine:
                came_back.add(engine.name)  # added again under its name: a new engine
            self._seen[engine.name] = engine
            if not engine.up:
                self._down_since.setdefault(engine.name, now)
            elif self._down_since.pop(engine.name, None) is not None:
                came_back.add(engine.name)
        for name in list(self._down_since):
            if view.get(name) is None:
                del self._down_since[name]  # removed: `gone` below
        wanted = {**self.placed, **self.dispatch.replicas.pinned_placements()}
        out: dict[str, str] = {}
        for model, engine_name in wanted.items():
            found = view.get(engine_name)
            down_for = now - self._down_since.get(engine_name, now)
            gone = found is None or down_for > grace or engine_name in came_back
            if gone and self._retry_at.get(model, 0.0) <= now:
                out[model] = engine_name
        return out

    async def check(self) -> None:
        """Load every lost model again (one after another, so each sees the last one's
        placement: copies go where their siblings are not)."""
        for model, was_on in self.lost().items():
            try:
                entry = self.catalog.registry.resolve(model)
            except ModelyardError:  # no longer configured: nothing to keep loaded
                self.placed.pop(model, None)
                continue
            engine = self.dispatch.provider.view.get(was_on)
            if entry.spec.engine is not None and (engine is None or not engine.up):
                continue  # pinned to an engine that left: it comes back with the engine
            try:
                if model in self.placed:
                    now_on = await self._load(model)
                else:
                    now_on = await self.dispatch.replicas.replace_copy(entry)
            except ModelyardError as exc:
                self._retry_at[model] = self._now() + RETRY_S
                log.error("%s was on %s, which left; not loaded elsewhere: %s", model, was_on,
                          exc.full_message())
                continue
            self._retry_at.pop(model, None)
            log.warning("%s was on %s, which left or stayed down: loaded on %s", model, was_on,
                        now_on)
