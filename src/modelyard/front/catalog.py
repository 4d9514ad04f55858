"""The front's catalog: the settings in force, the models they and the disk name, and the pulls
that add to them.

A reload (front/ops/reload.py) replaces `settings` and `registry` together; everything else reads
them here, so one reload is seen by every handler and by the dispatcher at once.
"""

from __future__ import annotations

import asyncio

from modelyard.config import Settings
from modelyard.errors import ModelLoadFailed, ModelNotPulled
from modelyard.front.ops.jobs import PullJobs
from modelyard.store.registry import Entry, ModelRegistry
from modelyard.wire.engines import EngineProvider


class Catalog:
    def __init__(
        self,
        settings: Settings,
        registry: ModelRegistry,
        jobs: PullJobs,
        provider: EngineProvider,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.jobs = jobs  # pulls from a hub (front/ops/jobs.py)
        self.provider = provider  # whose engines a rescan reaches

    async def resolve(self, name: str) -> Entry:
        """The catalog entry `name` reaches; with `auto_pull`, a hub reference not yet on disk
        is pulled first (the request waits for the download)."""
        try:
            return self.registry.resolve(name)
        except ModelNotPulled:
            if not self.settings.auto_pull:
                raise
        submitted, _ = await self.jobs.submit(name)
        job = await self.jobs.wait(submitted["id"])
        if job["status"] != "succeeded":
            raise ModelLoadFailed(
                f"auto_pull of '{name}' {job['status']}: {job.get('error')}", model=name
            )
        await self.rescan()
        return self.registry.resolve(job.get("model_id") or name)

    async def rescan(self) -> None:
        """Rebuild the catalog (disk, database, config) here and in every engine."""
        self.registry = await asyncio.to_thread(ModelRegistry.build, self.settings)
        await asyncio.gather(*(e.rescan() for e in self.provider.view.engines if e.up),
                             return_exceptions=True)
