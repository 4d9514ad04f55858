"""What the engine knows of one model: its state and its runtime record (engine/loop.py).

Mutated only from the engine's event loop (DESIGN.md §3.1), like the rest of its state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from modelyard.config import ModelSpec
from modelyard.engine.backends.base import Backend
from modelyard.engine.slot_queue import SlotQueue
from modelyard.errors import ModelyardError
from modelyard.placement.devices import Placement
from modelyard.store.registry import Entry


def file_identity(path: Path | None) -> tuple[int, int, int] | None:
    """(inode, size, mtime in ns) of `path`: what changes when a file is restored or replaced.
    None when there is no file (or none to look at)."""
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class ModelState(StrEnum):
    STOPPED = "stopped"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"


@dataclass
class Runtime:
    entry: Entry
    state: ModelState = ModelState.STOPPED
    server: Backend | None = None
    load: asyncio.Task[None] | None = None
    leases: set[str] = field(default_factory=set)
    cooldown_until: float = 0.0
    last_error: ModelyardError | None = None
    # Its file as the failed load found it ((inode, size, mtime); None: absent): a file that is
    # back or changed since deserves a new try before the cooldown ends.
    failed_file: tuple[int, int, int] | None = None
    loaded_at: float | None = None
    load_duration_s: float | None = None
    last_used: float = 0.0
    restarts: int = 0
    reserved_bytes: int = 0  # what the ledger promised it when it was placed
    pid: int | None = None  # the process holding its memory, from spawn to stop
    measured_bytes: int | None = None  # what the device shows that process holding now
    # Where its memory goes (devices and bytes on each, host RAM of a partial offload), from
    # the decision that placed it; once ready, the bytes measured on each device replace the
    # estimate's (`measured_placement`).
    placement: Placement | None = None
    measured_by_device: dict[int, int] = field(default_factory=dict)
    known_bytes: int | None = None  # measured while ready: the next load's estimate
    keep_alive_s: float | None = None  # the last request's keep_alive; None: the configured one
    waiting_since: float | None = None  # a load waiting for busy models to make room
    waiters: int = 0  # requests in acquire() that have no lease yet: the load is for them
    listeners: set[Callable[[str], None]] = field(default_factory=set)  # swap progress
    # A reload changed or removed its spec: it stops once idle, then takes `retire_to` (None:
    # it is forgotten); meanwhile requests wait instead of leasing the old server.
    retiring: asyncio.Task[None] | None = None
    retire_to: Entry | None = None
    read_ahead: bool = False  # this load's GGUF read-ahead was asked for
    # The device counts its backend can split it over (vLLM: divisors of the attention heads);
    # None: any.
    split_sizes: frozenset[int] | None = None
    # Why its backend cannot use the engine's GPUs (engine/reach.py): then it is placed whole
    # in host RAM, and its status says why. Set before each placement.
    cpu_reason: str | None = None
    # Its `max_concurrency` lease slots and the requests waiting for one (engine/slot_queue.py).
    slots: SlotQueue = field(default_factory=SlotQueue)

    @property
    def spec(self) -> ModelSpec:
        return self.entry.spec

