"""The front's view of engines: `EngineClient` (one engine) and `EngineProvider` (which exist).

The front knows an engine only through an `EngineClient` (DESIGN.md §1, §3.11): whether the
engine runs in the front's process, in a local subprocess or on another machine is the
provider's business. Everything the front needs from an engine is here — leases, loads, the
catalog (`rescan`), configuration (`reload`), reports, the logs of its backends and the session-KV
slots of its llama-servers — so no front module reads an engine's files or rebuilds a backend's
command line.

An `EngineProvider` yields the set of engines, addressed by name, as a versioned view
(`EngineSet`): engines may be added, go down, come back up or be removed while the front runs.
A view is immutable; `changed(version)` waits for the next one. Whether an engine is up is the
client's own `up` (it changes between probes); the provider bumps the version when it notices.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel

from modelyard.errors import ModelyardError
from modelyard.types import Lease
from modelyard.wire.catalog import CatalogSnapshot
from modelyard.wire.cluster import NodeReport
from modelyard.wire.doctor import EngineDoctor
from modelyard.wire.lease import Ticket
from modelyard.wire.logs import LogLine
from modelyard.wire.status import EngineStatus

SlotAction = Literal["restore", "save"]


class Abortable(Protocol):
    """A relay in flight that the engine's client may end (front/dispatch/drain.py)."""

    def abort(self, exc: ModelyardError) -> None: ...


class EngineClient(Protocol):
    name: str

    @property
    def up(self) -> bool: ...

    # ---- leases (the hot path: acquire once per request; release never awaits) --------------

    async def acquire(
        self,
        model: str,
        keep_alive_s: float | None = None,
        on_progress: Callable[[str], None] | None = None,
        queue: Ticket | None = None,  # how it waits for a slot there (serve --workers N)
    ) -> Lease: ...

    def lease_now(self, model: str, keep_alive_s: float | None = None) -> Lease | None:
        """A lease at once, without awaiting, when one can be had so (a model loaded in this
        process's engine; a lease this front gave back a moment ago): None says "acquire"."""
        ...

    def release(self, lease: Lease, *, keep: bool = True) -> None:
        """Give `lease` back; `keep=False`: to the engine now, never kept for reuse (a tool
        loop between rounds: its next request comes after its tools, not in a moment)."""
        ...

    def watch(self, relay: Abortable) -> Callable[[], None]:
        """Abort `relay` if this engine goes down while it runs; returns the unwatch call."""
        ...

    # ---- models, catalog, configuration -----------------------------------------------------

    async def load(self, model: str, keep_alive_s: float | None = None) -> dict[str, Any]: ...

    async def unload(self, model: str) -> dict[str, Any]: ...

    async def rescan(self, catalog: CatalogSnapshot | None = None) -> None:
        """Catalog sync: take the front's catalog (after a pull, an import, a config change);
        None asks a local engine to re-read it itself."""
        ...

    async def reload(self, settings: BaseModel) -> dict[str, Any]:
        """Take up a new configuration (the front's `Settings`)."""
        ...

    # ---- reports ----------------------------------------------------------------------------

    async def status(self) -> EngineStatus: ...

    def latest_status(self) -> EngineStatus | None:
        """The engine's status as it last pushed it (no round trip; routing reads it), or
        None when there is none: then `status()`."""
        ...

    async def diag(self) -> dict[str, Any]: ...

    async def doctor(self) -> EngineDoctor:
        """What `modelyard doctor` needs of this engine: its GPUs, driver, NVML accounting and
        backends' builds (seconds: torch is asked in a child process)."""
        ...

    # ---- logs -------------------------------------------------------------------------------

    async def read_log(
        self, model: str | None, after: int | None, limit: int
    ) -> tuple[list[LogLine], int]:
        """Lines of `model`'s backend (None: of the engine itself) after seq `after` (oldest
        first, at most `limit`), or its last `limit` lines when `after` is None; and the seq to
        follow from."""
        ...

    def follow_log(
        self, model: str | None, after: int
    ) -> AsyncGenerator[list[LogLine], None]:
        """Batches of lines after seq `after` as they are written, until the caller closes it;
        an empty batch now and then while nothing is written (a chance to stop)."""
        ...

    # ---- session KV (llama-server slots; front/chat/sessions/kv.py)
    # --------------------------------

    async def kv_slots(self, model: str) -> int | None:
        """How many slots `model`'s server has when it saves and restores them; else None."""
        ...

    async def kv_slot(self, model: str, slot: int, action: SlotAction, key: str) -> bool:
        """Restore session `key`'s saved KV into `slot` of `model`'s server, or save the slot
        for it; False when there was nothing to restore or the server refused (a lost cache hit,
        never an error). The caller holds a lease on `model`."""
        ...

    def kv_drop(self, key: str) -> None:
        """Session `key` is gone: so are its saved slots (an engine in this process deletes them
        now, an engine process is asked in the background: session deletion never waits)."""
        ...


@dataclass(frozen=True)
class EngineSet:
    """The engines at one moment, in a stable order; `version` grows with every change."""

    version: int = 0
    engines: tuple[EngineClient, ...] = ()
    _by_name: dict[str, EngineClient] = field(default_factory=dict, init=False, repr=False,
                                              compare=False)

    def __post_init__(self) -> None:
        self._by_name.update((e.name, e) for e in self.engines)

    def get(self, name: str) -> EngineClient | None:
        return self._by_name.get(name)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.engines]


class EngineProvider(Protocol):
    """Where the front's engines come from: in this process, local subprocesses, a cluster."""

    @property
    def view(self) -> EngineSet:
        """The engines now (no await: routing reads it per request)."""
        ...

    @property
    def gpu_count(self) -> int:
        """GPUs the engines own, for reports."""
        ...

    async def changed(self, version: int) -> EngineSet:
        """The first view newer than `version` (at once if there is one already)."""
        ...

    async def start(self) -> None:
        """Start (or attach to) the engines; returns once the first ones are up."""
        ...

    async def stop(self) -> None: ...


@runtime_checkable
class ClusterView(Protocol):
    """A provider that serves the engines of several nodes (front/engines/ray_provider.py) also
    lists its nodes and drains them: the admin API (front/api/cluster.py) asks `isinstance`, so a
    single-machine provider needs nothing extra."""

    def nodes(self) -> list[NodeReport]: ...

    async def drain(self, host: str, on: bool = True) -> NodeReport:
        """Stop (or, with `on=False`, resume) new loads on `host`; NodeNotFound if it is not
        one of the cluster's nodes."""
        ...
