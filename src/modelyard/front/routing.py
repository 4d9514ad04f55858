"""Which engine serves a request (DESIGN.md §1): pure, so it is tested as a table.

Order: the model's pinned engine; an engine where it is already resident (no reload); the
default engine; the least-loaded compatible engine (fewest evictions needed, then least queued).
Engines that are down or cannot run the model's format are never chosen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from modelyard.engine import scheduler
from modelyard.engine.ledger import Loading, plannable_free

# A load that only busy models could make room for ranks below any number of evictions.
BUSY_EVICTIONS = 1000


@dataclass(frozen=True)
class EngineView:
    name: str
    up: bool = True
    compatible: bool = True
    resident: frozenset[str] = field(default_factory=frozenset)
    evictions_needed: int = 0
    queued: int = 0


def pick_engine(
    engines: Sequence[EngineView],
    model: str,
    *,
    pinned: str | None = None,
    default: str | None = None,
) -> str | None:
    usable = [e for e in engines if e.up and e.compatible]
    if not usable:
        return None
    by_name = {e.name: e for e in usable}
    if pinned is not None:
        # A pin is a hard constraint: if that engine cannot serve, nothing else should.
        return pinned if pinned in by_name else None
    resident = [e for e in usable if model in e.resident]
    if resident:
        return min(resident, key=lambda e: e.queued).name
    if default is not None and default in by_name:
        return default
    return min(usable, key=lambda e: (e.evictions_needed, e.queued)).name


def _bytes(m: Mapping[str, Any]) -> tuple[int, int]:
    mem = m.get("memory") or {}
    return int(mem.get("reserved_bytes") or 0), int(mem.get("measured_bytes") or 0)


def _resident(m: Mapping[str, Any]) -> scheduler.Resident:
    """As the engine counts it (Engine._resident): a loading model holds at least what it was
    promised and is busy; a ready one holds what was measured."""
    reserved, measured = _bytes(m)
    loading = m["state"] == "loading"
    return scheduler.Resident(
        model=m["model"],
        bytes=max(reserved, measured) if loading else (measured or reserved),
        leases=int(m.get("leases", 0)) + (1 if loading else 0),
        pinned=bool(m.get("pinned")),
        priority=int(m.get("priority") or 0),
        last_used=float(m.get("last_used") or 0.0),
        group=m.get("group"),
    )


def view_from_status(
    name: str, status: Mapping[str, Any], want: scheduler.Want, queued: int = 0
) -> EngineView:
    """What routing needs to know of an engine, from its /status snapshot: whether `want` is
    resident there, and how many evictions loading it would take (the engine's own policy,
    run on the snapshot). An engine where it can never fit is incompatible."""
    models = [m for m in status.get("models", []) if m["state"] in ("ready", "loading")]
    resident = frozenset(m["model"] for m in models)
    device = status.get("device") or {}
    loading = [Loading(*_bytes(m)) for m in models if m["state"] == "loading"]
    decision = scheduler.plan(
        want,
        [_resident(m) for m in models],
        plannable_free(int(device.get("free_bytes") or 0), loading),
        int(device.get("total_bytes") or 0),
        max_loaded_models=(status.get("scheduler") or {}).get("max_loaded_models"),
    )
    compatible = not isinstance(decision, scheduler.NoFit)
    if isinstance(decision, scheduler.Evict):
        evictions = len(decision.victims)
    elif isinstance(decision, scheduler.Wait):
        evictions = BUSY_EVICTIONS
    else:
        evictions = 0
    return EngineView(
        name, compatible=compatible, resident=resident, evictions_needed=evictions, queued=queued
    )
