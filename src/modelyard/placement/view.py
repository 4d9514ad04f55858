"""The policy's view of an engine, built from its typed status: ONE builder for both ends.

The engine plans from the same `ModelStatus` records it reports (engine/reports.py), and the
front runs `plan_from_status` on the report it received, so the front's prediction of a
decision is the engine's decision, not a copy of it that drifts (issue 16: the front once
ignored `coexist_with` and routed to an engine that then refused the load).

Several devices: `plan_from_status` gives the policy one room per device the status lists
(each device's free bytes less what models still loading will take *on it*, by their
placement) and, when the want may be offloaded, the host RAM the engine measured. Memory of
warm-tier models is reported for the group only, so it counts as free on the group's first
device (where a one-device engine always counted it; a warm model's room comes back where it
was, so this errs on one device only, and only until its reclaim is measured).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

from modelyard.placement import policy as scheduler
from modelyard.placement.devices import DeviceRoom, Placement
from modelyard.placement.ledger import Loading, plannable_free
from modelyard.wire.status import EngineStatus, ModelStatus

__all__ = ["device_rooms", "loading", "plan_from_status", "resident", "residents"]


def _scaled(placement: Placement, nbytes: int) -> Placement:
    """`placement` holding `nbytes` on its devices in all, in the same proportions (what was
    measured replaces what was promised; the rounding goes to the first device)."""
    promised = placement.bytes
    if promised <= 0 or promised == nbytes or not placement.device_bytes:
        return placement
    parts = [(d, b * nbytes // promised) for d, b in placement.device_bytes]
    rest = nbytes - sum(b for _, b in parts)
    parts[0] = (parts[0][0], parts[0][1] + rest)
    return dataclasses.replace(placement, device_bytes=tuple(parts))


def resident(m: ModelStatus) -> scheduler.Resident:
    """`m` as the policy counts it: a loading model holds at least what it was promised and
    cannot be evicted (it counts as busy); a ready one holds what was measured (what it was
    promised until the device shows it)."""
    reserved = m.memory.reserved_bytes or 0
    measured = m.memory.measured_bytes or 0
    is_loading = m.state == "loading"
    held = max(reserved, measured) if is_loading else (measured or reserved)
    return scheduler.Resident(
        model=m.model,
        bytes=held,
        leases=m.leases + (1 if is_loading else 0),
        pinned=m.pinned,
        priority=m.priority,
        last_used=m.last_used,
        group=m.group,
        coexist_with=frozenset(m.coexist_with),
        reload_cost_s=m.load_duration_s or 0.0,
        keep_alive_s=m.keep_alive_s,
        waiters=m.waiters,
        placement=_scaled(m.placement, held) if m.placement is not None else None,
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


def device_rooms(status: EngineStatus) -> tuple[DeviceRoom, ...]:
    """One room per device of the status: its free bytes less what loading models will still
    take on it (a loading model's pending bytes spread as its placement spreads them; without
    a placement, on the first device); warm-tier bytes on the first device."""
    pending: dict[int, int] = {}
    first = status.devices[0].index if status.devices else 0
    for m in status.models:
        if m.state != "loading":
            continue
        left = max(0, (m.memory.reserved_bytes or 0) - (m.memory.measured_bytes or 0))
        spread = (_scaled(m.placement, left) if m.placement is not None
                  and m.placement.bytes > 0 else Placement.whole(first, left))
        for d, b in spread.device_bytes:
            pending[d] = pending.get(d, 0) + b
    return tuple(
        DeviceRoom(
            dev.index,
            max(0, (dev.free_bytes or 0) - pending.get(dev.index, 0))
            + (status.device.warm_bytes if i == 0 else 0),
            dev.total_bytes,
        )
        for i, dev in enumerate(status.devices)
    )


def plan_from_status(status: EngineStatus, want: scheduler.Want) -> scheduler.Decision:
    """What the engine that reported `status` decides for `want` (the want itself, if it is
    loading, is resident: Ready). The engine promises a model what its status says its next load
    takes, and places loads in the order they began: `want` waits behind those before it. A
    want whose backend the status lists in `cpu_backends` (it cannot use the engine's GPUs) is
    placed in host RAM, with that reason."""
    known = status.model(want.model)
    if known is not None and known.memory.load_bytes is not None:
        want = dataclasses.replace(want, bytes=known.memory.load_bytes)
    # Its backend cannot use this engine's GPUs (DESIGN.md §3.15): placed in host RAM.
    if want.cpu_reason is None and want.backend is not None:
        want = dataclasses.replace(want, cpu_reason=status.cpu_backends.get(want.backend))
    ahead = tuple(itertools.takewhile(lambda m: m != want.model, status.scheduler.placing))
    models = status.models
    host = status.host
    host_room = (DeviceRoom(-1, host.free_bytes or 0, host.total_bytes)
                 if (want.offload or want.cpu_reason is not None) and host is not None
                 else None)
    if status.devices:
        rooms = device_rooms(status)
        return scheduler.plan(
            want,
            residents(models),
            sum(r.free_bytes for r in rooms),
            sum(r.total_bytes for r in rooms),
            max_loaded_models=status.scheduler.max_loaded_models,
            ahead=ahead,
            devices=rooms,
            host=host_room,
        )
    return scheduler.plan(
        want,
        residents(models),
        # Warm-tier models give their device memory back to any load that needs it.
        plannable_free(status.device.free_bytes or 0, loading(models)) + status.device.warm_bytes,
        status.device.total_bytes,
        max_loaded_models=status.scheduler.max_loaded_models,
        ahead=ahead,
        host=host_room,
    )
