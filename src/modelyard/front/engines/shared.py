"""`serve --workers N`: N front processes, one set of engines (docs/operations.md, workers).

Worker 0 is the `serve` process itself: it supervises the engines (LocalEngines) and its worker
processes. Every engine it starts takes the one secret of this `serve` (a cluster's engines
share theirs the same way, wire/cluster.py), which the workers were handed in their token; so
a worker attaches to the same engine processes with the same `HttpEngineClient` a front uses,
over the same authenticated HTTP API and lease channel: the engine sees every worker's leases,
and `max_concurrency` holds at the engine as it does for several fronts.

Where the engines answer changes when one restarts (a fresh port). Worker 0 writes the set to
`run/engines.json` (the owner's only, no secret in it) each time it publishes a new one;
the workers read it when its mtime moves (one stat every ENGINES_FILE_POLL_S) and attach to an
engine whose address changed. Between a restart and the next read, that engine's lease channel
is closed, so a worker's client fails fast with 503 engine_unavailable, as worker 0's does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from modelyard.config import Settings
from modelyard.front.engines.catalog_feed import CatalogFeed
from modelyard.front.engines.client import EngineClient, HttpEngineClient
from modelyard.front.engines.provider import FileLog, LocalEngines, _Published
from modelyard.front.engines.supervisor import engine_log_path

log = logging.getLogger("modelyard.workers")

ENGINES_FILE = "engines.json"
ENGINES_FILE_POLL_S = 0.2


@dataclass(frozen=True)
class Worker:
    """This process's place among the workers of one `serve --workers N`."""

    index: int  # 0: the supervisor (engines, worker processes); 1..N-1 the others
    count: int
    secret: str  # the engines' secret, the same for every engine of this `serve`

    def engines_file(self, settings: Settings) -> Path:
        return settings.home / "run" / ENGINES_FILE


def write_engines(path: Path, clients: Sequence[HttpEngineClient]) -> None:
    """Where each engine answers now (attached ones only), atomically, owner-only."""
    found = [{"name": c.name, "index": c.index, "base_url": c.address[0],
              "lease_port": c.address[1]} for c in clients if c.address[1]]
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(found, out)
    os.replace(tmp, path)


class PublishingEngines(LocalEngines):
    """Worker 0's engines: LocalEngines that tell the workers where they answer."""

    def __init__(self, settings: Settings, worker: Worker, *, config_file: Path | None = None,
                 catalog: CatalogFeed | None = None) -> None:
        super().__init__(settings, config_file=config_file, catalog=catalog,
                         secret=worker.secret)
        self.path = worker.engines_file(settings)

    def _publish(self, engines: Sequence[EngineClient] | None = None) -> None:
        super()._publish(engines)
        try:
            write_engines(self.path, list(self._clients.values()))
        except OSError as exc:  # a full disk: the workers keep the set they know
            log.error("could not tell the workers where the engines are: %s", exc)


class SharedEngines(_Published):
    """A worker's engines: the ones worker 0 supervises, attached as it publishes them."""

    def __init__(self, settings: Settings, worker: Worker, *,
                 catalog: CatalogFeed | None = None) -> None:
        super().__init__()
        self.settings = settings
        self.secret = worker.secret
        self.path = worker.engines_file(settings)
        self.catalog = catalog
        self._clients: dict[str, HttpEngineClient] = {}
        self._seen = -1
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._follow(), name="shared-engines")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for client in self._clients.values():
            await client.detach()

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(ENGINES_FILE_POLL_S)
            try:
                await self.refresh()
            except Exception:  # the next poll tries again
                log.exception("reading %s failed", self.path)

    async def refresh(self) -> None:
        """Attach to what worker 0 last published, if it changed since the last read."""
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if mtime == self._seen:
            return
        self._seen = mtime
        try:
            found = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self._seen = -1  # caught mid-replace: read it again next time
            return
        names = set()
        for item in found:
            name, address = str(item["name"]), (str(item["base_url"]), int(item["lease_port"]))
            names.add(name)
            client = self._clients.get(name)
            if client is None:
                client = self._clients[name] = HttpEngineClient(
                    name, int(item["index"]), catalog=self.catalog,
                    process_log=FileLog(engine_log_path(self.settings, name), name))
            if client.address != address or not client.up:
                await client.detach()
                try:
                    await client.attach(
                        *address, self.secret,
                        report_timeout_s=self.settings.engine_health_timeout_s,
                        heartbeat_timeout_s=self.settings.engine_heartbeat_timeout_s)
                except OSError as exc:  # restarted meanwhile: the next publication says where
                    log.warning("%s: cannot attach at %s: %s", name, address[0], exc)
        for name in [n for n in self._clients if n not in names]:
            await self._clients.pop(name).detach()
        self._publish(list(self._clients.values()))
