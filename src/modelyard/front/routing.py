"""Which engine serves a request (DESIGN.md §1): pure, so it is tested as a table.

Order: the model's pinned engine; an engine where it is already resident (no reload); the
default engine; the least-loaded compatible engine (fewest evictions needed, then least queued).
Engines that are down or cannot run the model's format are never chosen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


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
