"""The policy's view of an engine, built from its typed status: ONE builder for both ends.

The engine plans from the same `ModelStatus` records it reports (engine/loop.py), and the front
runs `plan_from_status` on the report it received, so the front's prediction of a decision is
the engine's decision, not a copy of it that drifts (issue 16: the front once ignored
`coexist_with` and routed to an engine that then refused the load).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

from modelyard.placement import policy as scheduler
from modelyard.placement.ledger import Loading, plannable_free
from modelyard.wire.status import EngineStatus, ModelStatus

__all__ = ["loading", "plan_from_status", "resident", "residents"]


def resident(m: ModelStatus) -> scheduler.Resident:
    """`m` as the policy counts it: a loading model holds at least what it was promised and
    cannot be evicted (it counts as busy); a ready one holds what was measured (what it was
    promised until the device shows it)."""
    reserved = m.memory.reserved_bytes or 0
    measured = m.memory.measured_bytes or 0
    is_loading = m.state == "loading"
    return scheduler.Resident(
        model=m.model,
        bytes=max(reserved, measured) if is_loading else (measured or reserved),
        leases=m.leases + (1 if is_loading else 0),
        pinned=m.pinned,
        priority=m.priority,
        last_used=m.last_used,
        group=m.group,
        coexist_with=frozenset(m.coexist_with),
        reload_cost_s=m.load_duration_s or 0.0,
        keep_alive_s=m.keep_alive_s,
        waiters=m.waiters,
    )


def residents(models: Iterable[ModelStatus]) -> list[scheduler.Resident]:
    """The models that hold (or are promised) memory: loaded or loading."""
    return [resident(m) for m in models if m.resident]


def loading(models: Iterable[ModelStatus]) -> list[Loading]:
    """What models still loading were promised, and hold so far."""
    return [
        Loading(m.memory.reserved_bytes or 0, m.memory.measured_bytes or 0)
        for m in models
        if m.state == "loading"
    ]


def plan_from_status(status: EngineStatus, want: scheduler.Want) -> scheduler.Decision:
    """What the engine that reported `status` decides for `want` (the want itself, if it is
    loading, is resident: Ready). The engine promises a model what its status says its next load
    takes, and places loads in the order they began: `want` waits behind those before it."""
    known = status.model(want.model)
    if known is not None and known.memory.load_bytes is not None:
        want = dataclasses.replace(want, bytes=known.memory.load_bytes)
    ahead = tuple(itertools.takewhile(lambda m: m != want.model, status.scheduler.placing))
    models = status.models
    return scheduler.plan(
        want,
        residents(models),
        # Warm-tier models give their device memory back to any load that needs it.
        plannable_free(status.device.free_bytes or 0, loading(models)) + status.device.warm_bytes,
        status.device.total_bytes,
        max_loaded_models=status.scheduler.max_loaded_models,
        ahead=ahead,
    )
