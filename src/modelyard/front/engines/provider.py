"""Where the front's engines come from (wire/engines.py `EngineProvider`): the one module of the
front that may import the engine (the in-process provider) and child-process code (the local
provider and its supervisor), DESIGN.md §2.

- `InProcessEngines` (`--single-process`): engines in this process, `LocalEngineClient` each.
- `LocalEngines` (`modelyard serve`): one supervised engine process per GPU (one CPU engine when
  there is none), `HttpEngineClient` each (front/engines/supervisor.py restarts them).

Both address engines by name and publish a new `EngineSet` whenever one is added, removed, or
found up or down; `add` and `remove` change the set while the front runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from modelyard.config import Settings
from modelyard.errors import InvalidRequest
from modelyard.front.dispatch.drain import Abortable
from modelyard.front.engines.catalog_feed import CatalogFeed
from modelyard.front.engines.client import EngineClient, HttpEngineClient
from modelyard.front.engines.supervisor import (
    EnginePlan,
    EngineSupervisor,
    engine_log_path,
    plan_engines,
)
from modelyard.front.ops.logs import BufferLog, LogBuffer
from modelyard.hw.simulated import parse_simulated_gpus
from modelyard.hw.smi import query_gpus
from modelyard.proc.logfile import FileLog
from modelyard.proc.process import ChildProcess
from modelyard.store.registry import ModelRegistry
from modelyard.types import Lease
from modelyard.wire.catalog import CatalogSnapshot
from modelyard.wire.doctor import EngineDoctor
from modelyard.wire.engines import EngineSet, SlotAction
from modelyard.wire.lease import Ticket
from modelyard.wire.logs import LogLine
from modelyard.wire.status import EngineStatus

if TYPE_CHECKING:
    from modelyard.engine.loop import Engine
    from modelyard.engine.session_slots import SessionSlots

__all__ = ["ChildProcess", "FileLog", "InProcessEngines", "LocalEngineClient", "LocalEngines",
           "count_gpus"]

log = logging.getLogger("modelyard.front.engines.client")


def count_gpus(settings: Settings) -> int:
    """GPUs to start engines for: simulated ones, else what nvidia-smi reports."""
    if settings.simulate_gpus:
        return len(parse_simulated_gpus(settings.simulate_gpus))
    return 0 if settings.devices == "cpu" else len(query_gpus())


class _Published:
    """The versioned set of engines a provider publishes."""

    def __init__(self, gpu_count: int = 0) -> None:
        self._view = EngineSet()
        self._changed = asyncio.Event()
        self._gpu_count = gpu_count

    @property
    def view(self) -> EngineSet:
        return self._view

    @property
    def gpu_count(self) -> int:
        return self._gpu_count

    def _publish(self, engines: Sequence[EngineClient] | None = None) -> None:
        """A new view: `engines` (in order), or the same engines when one went up or down."""
        found = tuple(self._view.engines if engines is None else engines)
        self._view = EngineSet(self._view.version + 1, found)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def changed(self, version: int) -> EngineSet:
        while self._view.version <= version:
            await self._changed.wait()
        return self._view


# ---- in this process --------------------------------------------------------------------------


class LocalEngineClient:
    """The engine lives in this process (`--single-process`)."""

    def __init__(self, engine: Engine, *, own_log: BufferLog | None = None) -> None:
        from modelyard.engine.session_slots import SessionSlots

        self.engine = engine
        self.index = engine.index
        self.name = f"engine-{engine.index}"
        self.own_log = own_log  # its records, in this process's log ring
        self.slots: SessionSlots = SessionSlots(engine)

    @property
    def up(self) -> bool:
        return True

    async def acquire(
        self,
        model: str,
        keep_alive_s: float | None = None,
        on_progress: Callable[[str], None] | None = None,
        queue: Ticket | None = None,
    ) -> Lease:
        lease = self.engine.lease_ready(model, keep_alive_s)  # the hot path: loaded already
        if lease is not None:
            return lease
        return await self.engine.acquire(model, keep_alive_s=keep_alive_s, progress=on_progress,
                                         ticket=queue)

    def lease_now(self, model: str, keep_alive_s: float | None = None) -> Lease | None:
        return self.engine.lease_ready(model, keep_alive_s)

    async def load(self, model: str, keep_alive_s: float | None = None) -> dict[str, Any]:
        lease = await self.engine.acquire(model, keep_alive_s=keep_alive_s)
        self.engine.release(lease.id)
        return {"model": lease.model, "status": "loaded",
                "load_duration_ns": lease.load_duration_ns}

    async def unload(self, model: str) -> dict[str, Any]:
        unloaded = await self.engine.unload(model)
        return {"model": model, "status": "unloaded" if unloaded else "not_loaded"}

    async def rescan(self, catalog: CatalogSnapshot | None = None) -> None:
        await self.engine.rescan(catalog)

    async def reload(self, settings: BaseModel) -> dict[str, Any]:
        assert isinstance(settings, Settings)
        return await self.engine.reload(settings)

    def release(self, lease: Lease, *, keep: bool = True) -> None:
        self.engine.release(lease.id)  # in this process: no frame to save, nothing kept

    async def status(self) -> EngineStatus:
        return self.engine.status()

    def latest_status(self) -> EngineStatus | None:
        return self.engine.status()  # in this process: as cheap as a copy

    async def diag(self) -> dict[str, Any]:
        return self.engine.diag()

    async def doctor(self) -> EngineDoctor:
        from modelyard.engine.doctor import engine_report

        return await asyncio.to_thread(engine_report, self.engine)

    def watch(self, relay: Abortable) -> Callable[[], None]:
        return _nothing  # in this process: it cannot stop while the front runs

    async def read_log(
        self, model: str | None, after: int | None, limit: int
    ) -> tuple[list[LogLine], int]:
        if model is None:
            return self.own_log.read(after, limit) if self.own_log is not None else ([], 0)
        from modelyard.engine.logs import model_log

        self.engine.registry.resolve(model)  # 404 model_not_found, as an engine process says
        return await asyncio.to_thread(model_log(self.engine.settings, model).read, after,
                                       limit)

    async def follow_log(
        self, model: str | None, after: int
    ) -> AsyncGenerator[list[LogLine], None]:
        if model is None:
            if self.own_log is None:
                return
            follower = self.own_log.follow(after)
        else:
            from modelyard.engine.logs import model_log

            follower = model_log(self.engine.settings, model).follow(after)
        async with contextlib.aclosing(follower) as batches:
            async for batch in batches:
                yield batch

    async def kv_slots(self, model: str) -> int | None:
        return self.slots.slots(model)

    async def kv_slot(self, model: str, slot: int, action: SlotAction, key: str) -> bool:
        return await self.slots.act(model, slot, action, key)

    def kv_drop(self, key: str) -> None:
        self.slots.drop(key)


def _nothing() -> None:
    pass


class InProcessEngines(_Published):
    """Engines in the front's process: one for `--single-process` (or those given)."""

    def __init__(
        self,
        settings: Settings,
        registry: ModelRegistry,
        *,
        engines: Sequence[Engine] = (),
        log_buffer: LogBuffer | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.registry = registry
        self.log_buffer = log_buffer
        self._given = list(engines)
        self._clients: dict[str, LocalEngineClient] = {}

    async def start(self) -> None:
        if not self._given:
            from modelyard.engine.loop import Engine

            self._given = [Engine(self.settings, self.registry)]
        for engine in self._given:
            self.add(engine)

    def add(self, engine: Engine) -> LocalEngineClient:
        """Start `engine` (not started yet) and publish it."""
        client = LocalEngineClient(engine)
        if client.name in self._clients:
            raise InvalidRequest(f"there is an engine '{client.name}' already")
        if self.log_buffer is not None and self.log_buffer.engine_source is None:
            # Its records go to this process's ring (front/ops/logs.py): the first engine's.
            self.log_buffer.engine_source = client.name
            client.own_log = BufferLog(self.log_buffer, client.name)
        engine.start()
        self._clients[client.name] = client
        self._publish(list(self._clients.values()))
        return client

    async def remove(self, name: str) -> None:
        """Unpublish engine `name`, then shut it down (its requests in flight end first)."""
        client = self._clients.pop(name, None)
        if client is None:
            return
        self._publish(list(self._clients.values()))
        await client.slots.close()
        await client.engine.shutdown()

    async def stop(self) -> None:
        for name in list(reversed(self._clients)):
            await self.remove(name)


# ---- local subprocesses -----------------------------------------------------------------------


class LocalEngines(_Published):
    """One supervised engine process per GPU (front/engines/supervisor.py), on this machine."""

    def __init__(self, settings: Settings, *, config_file: Path | None = None,
                 gpu_count: int | None = None, catalog: CatalogFeed | None = None,
                 secret: str | None = None) -> None:
        super().__init__(count_gpus(settings) if gpu_count is None else gpu_count)
        # One secret for every engine (a `serve --workers N`'s, front/engines/shared.py);
        # None: a fresh one each start.
        self.secret = secret
        self.settings = settings
        self.config_file = config_file
        self.catalog = catalog  # what its clients push to their engine on each attach
        self._supervisors: dict[str, EngineSupervisor] = {}
        self._clients: dict[str, HttpEngineClient] = {}  # their clients, in the same order

    async def start(self) -> None:
        for plan in plan_engines(self.settings, self.gpu_count):
            await self.add(plan)

    async def add(self, plan: EnginePlan) -> HttpEngineClient:
        """Start an engine process for `plan` and publish it once it answers."""
        name = f"engine-{plan.index}"
        if name in self._supervisors:
            raise InvalidRequest(f"there is an engine '{name}' already")
        client = HttpEngineClient(
            name, plan.index,
            process_log=FileLog(engine_log_path(self.settings, name), name),
            catalog=self.catalog,
        )
        supervisor = EngineSupervisor(self.settings, plan, client, config_file=self.config_file,
                                      on_change=self._publish, secret=self.secret)
        try:
            await supervisor.start()
        except BaseException:
            await supervisor.stop()
            raise
        self._supervisors[name] = supervisor
        self._clients[name] = client
        self._publish(list(self._clients.values()))
        return client

    async def remove(self, name: str) -> None:
        """Unpublish engine `name`, then stop its process (TERM, grace, KILL)."""
        supervisor = self._supervisors.pop(name, None)
        if supervisor is None:
            return
        self._clients.pop(name, None)
        self._publish(list(self._clients.values()))
        await supervisor.stop()

    def plan_of(self, name: str) -> EnginePlan | None:
        supervisor = self._supervisors.get(name)
        return supervisor.plan if supervisor is not None else None

    async def stop(self) -> None:
        for name in list(reversed(self._supervisors)):
            await self.remove(name)


class StaticEngines(_Published):
    """Engines someone else started and stops: the clients given, as they are."""

    def __init__(self, engines: Sequence[EngineClient], gpu_count: int = 0) -> None:
        super().__init__(gpu_count)
        self._publish(engines)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass
