"""The warm tier: models evicted from the device but kept ready, so the next load is a move.

A transformers model's converted module moves to host memory (on a CPU engine it stays where it
is) and a vLLM server sleeps (level 1: weights to host RAM, KV dropped; the process lives on).
Loading such a model again moves it back instead of re-reading and re-converting its files.

This module is the bookkeeping only, with no I/O and no awaits, so its decisions are tested as
a table: what fits (`warm_tier_bytes` and the host's free memory), who goes first (least
recently used) when the budget, the host or a load on the device needs the room. The engine
(engine/warm_flow.py) suspends, resumes and stops the backends it names.

Two figures per entry, because they are different ledgers:

* `host_bytes`: host RAM it holds, counted against `warm_tier_bytes`;
* `device_bytes`: what it still holds on the engine's device (the whole model on a CPU engine,
  whose device is host RAM; a sleeping vLLM's CUDA context on a GPU). A load may reclaim it:
  the engine reports it (`DeviceStatus.warm_bytes`) and placement counts it as free.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from modelyard.config import ModelSpec
from modelyard.wire.status import ModelStatus

__all__ = ["HOST_FLOOR_FRACTION", "WarmEntry", "WarmTier", "Warmable", "fingerprint"]

# Never fill the host past this: the warm tier is a cache, and an OOM-killed engine (or a
# swapping host) costs far more than the reload it saves.
HOST_FLOOR_FRACTION = 0.10


@runtime_checkable
class Warmable(Protocol):
    """A backend that can give its device memory back without forgetting its model."""

    def warm_bytes(self) -> int:
        """Host RAM it will hold once suspended (its weights)."""
        ...

    async def suspend(self) -> bool:
        """Free the device memory, keep the model; False when it could not (the caller stops
        it instead)."""
        ...

    async def resume(self) -> None:
        """Back on the device and serving; raises ModelLoadFailed (and stops) if it cannot."""
        ...


def fingerprint(spec: ModelSpec) -> str:
    """What must not change between eviction and the next load for the warm copy to be the
    model asked for: the whole spec (path, options, quantization…)."""
    return spec.model_dump_json()


@dataclass
class WarmEntry:
    model: str
    fingerprint: str
    backend: Any  # a Backend that is also Warmable
    host_bytes: int
    device_bytes: int
    how: str  # "host" or "asleep" (wire/status.py ModelStatus.warm)
    since: float


class WarmTier:
    """Warm entries in least-recently-evicted order, within `budget_bytes` of host RAM."""

    def __init__(self, budget_bytes: int, clock: Callable[[], float]) -> None:
        self.budget_bytes = budget_bytes
        self.clock = clock
        self._entries: collections.OrderedDict[str, WarmEntry] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[WarmEntry]:
        return iter(list(self._entries.values()))

    def get(self, model: str) -> WarmEntry | None:
        return self._entries.get(model)

    @property
    def host_bytes(self) -> int:
        return sum(e.host_bytes for e in self._entries.values())

    @property
    def device_bytes(self) -> int:
        return sum(e.device_bytes for e in self._entries.values())

    def admits(
        self, host_bytes: int, *, new_host_bytes: int, host_free: int, host_total: int
    ) -> bool:
        """Whether a model holding `host_bytes` once warm may enter: it fits the budget (after
        dropping older entries) and the `new_host_bytes` it moves into host RAM leave the
        host its floor. (Dropping entries to make host room is not counted on: their memory
        comes back to the host only once gone, which is too late for the move.)"""
        if self.budget_bytes <= 0 or host_bytes > self.budget_bytes:
            return False
        return host_free - new_host_bytes >= host_total * HOST_FLOOR_FRACTION

    def admit(self, entry: WarmEntry) -> list[WarmEntry]:
        """Add `entry` (most recent); the older entries dropped to keep within the budget, for
        the caller to stop. A previous entry of the same model is replaced (and returned)."""
        dropped = []
        old = self._entries.pop(entry.model, None)
        if old is not None:
            dropped.append(old)
        self._entries[entry.model] = entry
        dropped += self._shrink_to(self.budget_bytes)
        return dropped

    def take(self, model: str, fingerprint: str) -> WarmEntry | None:
        """Remove and return `model`'s entry if it is the spec asked for; a stale one (the spec
        changed) stays for the caller to `drop`."""
        entry = self._entries.get(model)
        if entry is None or entry.fingerprint != fingerprint:
            return None
        return self._entries.pop(model)

    def drop(self, model: str) -> WarmEntry | None:
        return self._entries.pop(model, None)

    def resize(self, budget_bytes: int) -> list[WarmEntry]:
        """A new `warm_tier_bytes` (config reload): the entries that no longer fit."""
        self.budget_bytes = budget_bytes
        return self._shrink_to(budget_bytes)

    def reclaim(self, device_bytes: int, *, keep: str | None = None) -> list[WarmEntry]:
        """Entries to drop, least recent first, until they free `device_bytes` on the device
        (a load needs the room); `keep` (the model being loaded back) is never one."""
        victims: list[WarmEntry] = []
        freed = 0
        for entry in list(self._entries.values()):
            if freed >= device_bytes:
                break
            if entry.model == keep or entry.device_bytes <= 0:
                continue
            victims.append(self._entries.pop(entry.model))
            freed += entry.device_bytes
        return victims

    def _shrink_to(self, budget_bytes: int) -> list[WarmEntry]:
        dropped = []
        while self._entries and self.host_bytes > budget_bytes:
            dropped.append(self._entries.popitem(last=False)[1])
        return dropped

    def report(self, status: ModelStatus) -> ModelStatus:
        """`status` with its warm state, when the model is in the tier."""
        entry = self._entries.get(status.model)
        if entry is None or status.state != "stopped":
            return status
        memory = dataclasses.replace(status.memory, host_bytes=entry.host_bytes)
        return dataclasses.replace(status, warm=entry.how, memory=memory)
