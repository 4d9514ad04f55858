"""Which engine serves a request (DESIGN.md §1): pure, so it is tested as a table.

Order: the model's pinned engine; an engine where it is already resident (no reload); then,
among the engines that hold the model's files if any does (a node without the front's shared
storage must pull them first), the default engine; the least-loaded compatible engine (fewest
evictions needed, then one without a sibling copy of the model, then least queued).
Engines that are down or cannot run the model's format are never chosen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from modelyard.placement import policy as scheduler
from modelyard.placement import view as placement
from modelyard.wire.status import EngineStatus

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
    has_files: bool = True  # its node sees the model's files (EngineStatus.missing_files)


def pick_engine(
    engines: Sequence[EngineView],
    model: str,
    *,
    pinned: str | None = None,
    default: str | None = None,
    avoid: frozenset[str] = frozenset(),
) -> str | None:
    """`avoid`: engines that hold a sibling copy of `model` (front/dispatch/replicas.py): a cold
    copy goes elsewhere when another engine needs no more evictions."""
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
    with_files = [e for e in usable if e.has_files]
    if with_files:
        usable = with_files
    if default is not None and any(e.name == default for e in usable) and default not in avoid:
        return default
    return min(usable, key=lambda e: (e.evictions_needed, e.name in avoid, e.queued)).name


def view_from_status(
    name: str,
    status: EngineStatus,
    want: scheduler.Want,
    queued: int = 0,
) -> EngineView:
    """What routing needs to know of an engine, from its /status snapshot: whether `want` is
    resident there, and how many evictions loading it would take: the engine's own decision,
    made by the same builder and policy on the same fields (placement/view.py). An engine where
    it can never fit is incompatible."""
    resident = frozenset(m.model for m in status.models if m.resident)
    decision = placement.plan_from_status(status, want)
    compatible = not isinstance(decision, scheduler.NoFit)
    if isinstance(decision, scheduler.Evict):
        evictions = len(decision.victims)
    elif isinstance(decision, scheduler.Wait):
        evictions = BUSY_EVICTIONS
    else:
        evictions = 0
    return EngineView(
        name, compatible=compatible, resident=resident, evictions_needed=evictions, queued=queued,
        has_files=want.model not in status.missing_files,
    )
