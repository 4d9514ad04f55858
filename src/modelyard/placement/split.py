"""How a model's bytes go onto a set of devices (placement/policy.py chooses the set): the sets
a model may take, its bytes on one set, split by whole layers or evenly, and the layers kept in
host RAM when the devices cannot hold them all. Pure arithmetic on a `LayerProfile` and rooms.

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

import bisect
import functools
import itertools
from collections.abc import Sequence

from modelyard.placement.devices import DeviceRoom, LayerProfile, Placement, split_evenly

__all__ = ["device_sets", "fit", "fit_offloaded", "offload_layers", "split_layers"]


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


@functools.lru_cache(maxsize=32)  # a plan tries the same profile on every device set
def _cumulative(profile: LayerProfile) -> list[int]:
    """`cum[i]`: the bytes of layers 0..i-1, each with its KV cache (`cum[-1]`: all of them)."""
    return [0, *itertools.accumulate(b + profile.kv_bytes_per_layer for b in profile.layer_bytes)]


def _proportional(cum: Sequence[int], budgets: Sequence[int]) -> list[int]:
    """Layer counts per device: the boundary after device d at the layer where the running
    total comes nearest to d's proportional share of all layers' bytes (the lower on a tie)."""
    layers, total, room = len(cum) - 1, cum[-1], sum(budgets)
    counts: list[int] = []
    start, share = 0, 0
    for budget in budgets[:-1]:
        share += budget
        target = total * share / room if room else 0
        end = min(bisect.bisect_left(cum, target, lo=start), layers)
        if end > start and abs(cum[end - 1] - target) <= abs(cum[end] - target):
            end -= 1
        end = bisect.bisect_left(cum, cum[end], lo=start)  # the lowest of equal totals
        counts.append(end - start)
        start = end
    counts.append(layers - start)
    return counts


def _fill(cum: Sequence[int], first: int, budgets: Sequence[int]) -> list[int] | None:
    """Layer counts per device for layers `first`.., each device taking layers while they fit;
    None if some do not."""
    counts: list[int] = []
    i = first
    for budget in budgets:
        end = min(bisect.bisect_right(cum, cum[i] + budget) - 1, len(cum) - 1)
        counts.append(end - i)
        i = end
    return counts if i == len(cum) - 1 else None


def _fits(cum: Sequence[int], budgets: Sequence[int], counts: Sequence[int]) -> bool:
    start = 0
    for budget, n in zip(budgets, counts, strict=True):
        if cum[start + n] - cum[start] > budget:
            return False
        start += n
    return start == len(cum) - 1


def _placement(
    profile: LayerProfile,
    rooms: Sequence[DeviceRoom],
    cum: Sequence[int],
    counts: Sequence[int],
    host_bytes: int = 0,
    first: int = 0,
) -> Placement:
    """Layers `first`.. on `rooms`, `counts[d]` of them on device d, in order."""
    device_bytes = []
    start = first
    for i, (room, n) in enumerate(zip(rooms, counts, strict=True)):
        fixed = profile.compute_bytes_per_device + (profile.other_bytes if i == 0 else 0)
        device_bytes.append((room.index, fixed + cum[start + n] - cum[start]))
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
    cum = _cumulative(profile)
    if sum(budgets) < cum[-1]:  # the usual answer while a plan tries victims: say it cheaply
        return None
    counts: list[int] | None = _proportional(cum, budgets)
    if counts is None or not _fits(cum, budgets, counts):
        counts = _fill(cum, 0, budgets)
    if counts is None:
        return None
    return _placement(profile, rooms, cum, counts)


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
    whole = split_layers(profile, rooms)
    if whole is not None:
        return whole
    # The most layers whose tail fits: if the last n fit, so do the last n-1 (filling in order
    # only gets easier), so a binary search finds n in log(layers) fills.
    cum = _cumulative(profile)
    layers = profile.layers
    lo, hi = 0, layers - 1  # the last `lo` layers fit; all of them do not (no whole split)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fill(cum, layers - mid, budgets) is not None:
            lo = mid
        else:
            hi = mid - 1
    first = layers - lo
    counts = _fill(cum, first, budgets)
    assert counts is not None
    host = cum[first]
    if host > host_free:
        return None
    return _placement(profile, rooms, cum, counts, host, first)


def device_sets(
    rooms: Sequence[DeviceRoom], *, splittable: bool = True, sizes: frozenset[int] | None = None
) -> list[tuple[DeviceRoom, ...]]:
    """Single devices, then larger sets (only `sizes` when given; none when not `splittable`),
    each in index order. One device is always allowed: it is no split (1 divides any number of
    attention heads)."""
    largest = len(rooms) if splittable else 1
    allowed = [k for k in range(1, largest + 1) if k == 1 or sizes is None or k in sizes]
    ordered = sorted(rooms, key=lambda r: r.index)
    return [s for k in allowed for s in itertools.combinations(ordered, k)]


def fit(
    nbytes: int, profile: LayerProfile | None, rooms: Sequence[DeviceRoom]
) -> Placement | None:
    """A model of `nbytes` on exactly `rooms` (their free bytes), or None when it does not fit:
    whole on one device; split by layers with a profile, evenly without one."""
    if len(rooms) == 1:
        room = rooms[0]
        return Placement.whole(room.index, nbytes) if nbytes <= room.free_bytes else None
    if profile is not None:
        return split_layers(profile.scaled_to(nbytes), rooms)
    even = split_evenly(nbytes, [r.index for r in rooms])
    return even if all(even.on(r.index) <= r.free_bytes for r in rooms) else None


def fit_offloaded(
    nbytes: int, profile: LayerProfile | None, rooms: Sequence[DeviceRoom], host_free: int
) -> Placement | None:
    """Part of a model on `rooms`, the rest in host RAM (None: the rest does not fit there).
    Without a profile the devices are filled in order, by bytes (no layer counts)."""
    if profile is not None:
        return offload_layers(profile.scaled_to(nbytes), rooms, host_free)
    left, parts = nbytes, []
    for r in rooms:
        take = max(0, min(left, r.free_bytes))
        parts.append((r.index, take))
        left -= take
    if left > host_free:
        return None
    return Placement(device_bytes=tuple(parts), host_bytes=left)
