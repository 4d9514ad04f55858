"""The front's catalog: the settings in force, the models they and the disk name, and the pulls
that add to them.

A reload (front/ops/reload.py) replaces `settings` and `registry` together; everything else reads
them here, so one reload is seen by every handler and by the dispatcher at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar, cast

from modelyard.config import Settings
from modelyard.errors import ModelLoadFailed, ModelNotPulled
from modelyard.front.engines.catalog_feed import CatalogFeed
from modelyard.front.ops.jobs import PullJobs
from modelyard.store.draft import missing_hub_draft
from modelyard.store.registry import Entry, ModelRegistry
from modelyard.wire.engines import EngineProvider

T = TypeVar("T")


class Catalog:
    def __init__(
        self,
        settings: Settings,
        registry: ModelRegistry,
        jobs: PullJobs,
        provider: EngineProvider,
        feed: CatalogFeed | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.jobs = jobs  # pulls from a hub (front/ops/jobs.py)
        self.provider = provider  # whose engines a rescan reaches
        # What engines are pushed (front/engines/catalog_feed.py): they never read our database.
        self.feed = feed or CatalogFeed()
        # What `memo` built from `_memo_of`: a reload or rescan assigns a new registry.
        self._memo_of: ModelRegistry | None = None
        self._memo: dict[str, object] = {}

    def memo(self, name: str, build: Callable[[ModelRegistry], T]) -> T:
        """`build(registry)`, made once per registry and kept until the registry is replaced: a
        listing of 10,000 models cost 40 ms p50 and 0.5 s p99 (make bench-load) when rebuilt
        on each request, all of it on the event loop every other request waits on."""
        registry = self.registry
        if self._memo_of is not registry:
            self._memo_of, self._memo = registry, {}
        if name not in self._memo:
            self._memo[name] = build(registry)
        return cast(T, self._memo[name])

    async def resolve(self, name: str) -> Entry:
        """The catalog entry `name` reaches; with `auto_pull`, a hub reference not yet on disk
        is pulled first (the request waits for the download), and so is a speculative-decoding
        draft that names one (front/ops/draft_pulls.py)."""
        try:
            entry = self.registry.resolve(name)
        except ModelNotPulled:
            if not self.settings.auto_pull:
                raise
            pulled = await self._pull(name, name)
            # After the pull: the rescan replaced the registry (`self.registry` read before
            # the await would be the one without the model).
            entry = self.registry.resolve(pulled or name)
        if self.settings.auto_pull and getattr(entry.spec, "draft_model", None) is not None:
            draft = missing_hub_draft(entry.spec, self.registry)
            if draft is not None:
                await self._pull(draft, entry.name)
                entry = self.registry.resolve(entry.name)
        return entry

    async def _pull(self, ref: str, model: str) -> str | None:
        """Pull `ref` for a request to `model` and wait; the catalog is rescanned after. The
        pulled model's catalog id."""
        submitted, _ = await self.jobs.submit(ref)
        job = await self.jobs.wait(submitted["id"])
        if job["status"] != "succeeded":
            raise ModelLoadFailed(
                f"auto_pull of '{ref}' {job['status']}: {job.get('error')}", model=model
            )
        await self.rescan()
        model_id: str | None = job.get("model_id")
        return model_id

    async def rescan(self) -> None:
        """Rebuild the catalog (disk, database, config) here and push it to every engine."""
        self.registry = await asyncio.to_thread(ModelRegistry.build, self.settings)
        await self.push()

    async def push(self) -> None:
        """Push the catalog to every engine that is up (one that attaches later gets it from
        the feed before it is up)."""
        snapshot = await asyncio.to_thread(self.feed.publish, self.registry, self.settings)
        await asyncio.gather(*(e.rescan(snapshot) for e in self.provider.view.engines if e.up),
                             return_exceptions=True)
