"""Splitting one model over devices by whole layers, and keeping some layers in host RAM: pure
arithmetic on a `LayerProfile` and the rooms the policy found (placement/policy.py).

The split follows llama.cpp's `--split-mode layer`: each device holds a *contiguous* run of the
repeating layers (device order = the order of `rooms`), the KV cache of a layer goes with the
layer, every device that holds a part allocates its own compute buffer, and the weights outside
the blocks (`other_bytes`: embeddings, output head) sit on the first ("main") device.

Layers go to devices in proportion to the room each has left for layers, so the devices fill
about equally (a device that is fuller today keeps room for what comes next); when whole layers
cannot be rounded that way without overfilling one device, the split fills the devices in order
instead (for contiguous runs that finds a fit whenever one exists).
"""

from __future__ import annotations

from collections.abc import Sequence

from modelyard.placement.devices import DeviceRoom, LayerProfile, Placement

__all__ = ["offload_layers", "split_layers"]


def _budgets(profile: LayerProfile, rooms: Sequence[DeviceRoom]) -> list[int] | None:
    """Room for layers on each device: its room less its compute buffer (and the main device's
    other weights); None when a device cannot even hold those."""
    budgets = []
    for i, room in enumerate(rooms):
        fixed = profile.compute_bytes_per_device + (profile.other_bytes if i == 0 else 0)
        if room.free_bytes < fixed:
            return None
        budgets.append(room.free_bytes - fixed)
    return budgets


def _layer_costs(profile: LayerProfile) -> list[int]:
    return [b + profile.kv_bytes_per_layer for b in profile.layer_bytes]


def _proportional(costs: Sequence[int], budgets: Sequence[int]) -> list[int]:
    """Layer counts per device: the boundary after device d at the layer where the running
    total comes nearest to d's proportional share of all layers' bytes."""
    total, room = sum(costs), sum(budgets)
    counts: list[int] = []
    start, running, share = 0, 0, 0
    for d, budget in enumerate(budgets):
        if d == len(budgets) - 1:
            counts.append(len(costs) - start)
            break
        share += budget
        target = total * share / room if room else 0
        end = start
        while end < len(costs) and abs(running + costs[end] - target) < abs(running - target):
            running += costs[end]
            end += 1
        counts.append(end - start)
        start = end
    return counts


def _fill(costs: Sequence[int], budgets: Sequence[int]) -> list[int] | None:
    """Layer counts per device, each device taking layers while they fit; None if some do not."""
    counts: list[int] = []
    i = 0
    for budget in budgets:
        used, n = 0, 0
        while i < len(costs) and used + costs[i] <= budget:
            used += costs[i]
            i += 1
            n += 1
        counts.append(n)
    return counts if i == len(costs) else None


def _fits(costs: Sequence[int], budgets: Sequence[int], counts: Sequence[int]) -> bool:
    start = 0
    for budget, n in zip(budgets, counts, strict=True):
        if sum(costs[start : start + n]) > budget:
            return False
        start += n
    return start == len(costs)


def _placement(
    profile: LayerProfile,
    rooms: Sequence[DeviceRoom],
    counts: Sequence[int],
    host_bytes: int = 0,
    first: int = 0,
) -> Placement:
    """Layers `first`.. on `rooms`, `counts[d]` of them on device d, in order."""
    costs = _layer_costs(profile)
    device_bytes = []
    start = first
    for i, (room, n) in enumerate(zip(rooms, counts, strict=True)):
        fixed = profile.compute_bytes_per_device + (profile.other_bytes if i == 0 else 0)
        device_bytes.append((room.index, fixed + sum(costs[start : start + n])))
        start += n
    return Placement(device_bytes=tuple(device_bytes), host_bytes=host_bytes,
                     layers=tuple(counts), total_layers=profile.layers)


def split_layers(profile: LayerProfile, rooms: Sequence[DeviceRoom]) -> Placement | None:
    """All of the model's layers over `rooms` (in their order), in proportion to their room;
    None when they do not fit there."""
    if not rooms:
        return None
    budgets = _budgets(profile, rooms)
    if budgets is None:
        return None
    costs = _layer_costs(profile)
    counts: list[int] | None = _proportional(costs, budgets)
    if counts is None or not _fits(costs, budgets, counts):
        counts = _fill(costs, budgets)
    if counts is None:
        return None
    return _placement(profile, rooms, counts)


def offload_layers(
    profile: LayerProfile, rooms: Sequence[DeviceRoom], host_free: int
) -> Placement | None:
    """As many layers as fit on `rooms`, the rest in host RAM; None when the rest does not fit
    in `host_free` or the devices cannot hold even their fixed part (compute buffers, the main
    device's other weights). All layers fitting is a plain `split_layers`.

    The layers kept on the devices are the *last* ones, as llama.cpp's `--n-gpu-layers n` keeps
    layers n_layer-n.. on the GPUs; they fill the devices in order (the fewest device bytes
    wasted, the most layers on the devices: each layer left in host RAM runs at CPU speed)."""
    if not rooms:
        return None
    budgets = _budgets(profile, rooms)
    if budgets is None:
        return None
    costs = _layer_costs(profile)
    whole = split_layers(profile, rooms)
    if whole is not None:
        return whole
    for on_devices in range(len(costs) - 1, -1, -1):
        first = len(costs) - on_devices
        counts = _fill(costs[first:], budgets)
        if counts is None:
            continue
        host = sum(costs[:first])
        if host > host_free:
            return None
        return _placement(profile, rooms, counts, host, first)
    return None
