"""placement/split.py: whole layers over devices in proportion to their room, and the layers
that do not fit kept in host RAM (llama.cpp `--tensor-split`, `--n-gpu-layers`)."""

from __future__ import annotations

import pytest

from modelyard.placement.devices import DeviceRoom, LayerProfile
from modelyard.placement.split import (
    device_sets,
    fit,
    fit_offloaded,
    offload_layers,
    split_layers,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

GiB = 2**30

# 10 layers of 1 GiB weights + 1 GiB KV, 3 GiB outside the blocks, 1 GiB compute per device
PROFILE = LayerProfile((GiB,) * 10, GiB, 3 * GiB, GiB)


def rooms(*free: float) -> list[DeviceRoom]:
    return [DeviceRoom(i, int(f * GiB), 48 * GiB) for i, f in enumerate(free)]


def test_layers_in_proportion_to_room() -> None:
    # layer budgets 16 and 16 → 5 layers (10 GiB) each
    p = split_layers(PROFILE, rooms(20, 17))
    assert p is not None and p.layers == (5, 5) and p.total_layers == 10
    assert p.device_bytes == ((0, 14 * GiB), (1, 11 * GiB))
    assert p.host_bytes == 0 and p.gpu_layers is None


def test_more_room_takes_more_layers() -> None:
    p = split_layers(PROFILE, rooms(10, 25))  # budgets 6 and 24: 20 * 6/30 = 4 GiB → 2 layers
    assert p is not None and p.layers == (2, 8)


def test_falls_back_to_filling_in_order_when_rounding_overfills() -> None:
    # budgets 5.5 and 16: proportion says 5.1 GiB of layers → 3 layers (6 GiB), over 5.5
    p = split_layers(PROFILE, rooms(9.5, 17))
    assert p is not None and p.layers == (2, 8)
    assert all(b <= r.free_bytes
               for (_, b), r in zip(p.device_bytes, rooms(9.5, 17), strict=True))


def test_does_not_fit() -> None:
    assert split_layers(PROFILE, rooms(12, 10)) is None  # 20 GiB of layers, 18 of room
    assert split_layers(PROFILE, rooms(3, 40)) is None  # main device cannot hold its fixed part
    assert split_layers(PROFILE, []) is None


def test_offload_keeps_the_last_layers_on_the_devices() -> None:
    p = offload_layers(PROFILE, rooms(10), host_free=64 * GiB)  # budget 6: 3 layers
    assert p is not None and p.layers == (3,) and p.gpu_layers == 3
    assert p.host_bytes == 14 * GiB and p.device_bytes == ((0, 10 * GiB),)
    assert p.split_label() == "58%/42% CPU/GPU"


def test_offload_over_two_devices_and_whole_when_it_fits() -> None:
    p = offload_layers(PROFILE, rooms(10, 7), host_free=64 * GiB)  # budgets 6, 6
    assert p is not None and p.layers == (3, 3) and p.host_bytes == 8 * GiB
    whole = offload_layers(PROFILE, rooms(20, 17), host_free=0)
    assert whole == split_layers(PROFILE, rooms(20, 17))


def test_offload_needs_host_room() -> None:
    assert offload_layers(PROFILE, rooms(10), host_free=13 * GiB) is None
    assert offload_layers(PROFILE, rooms(3), host_free=64 * GiB) is None


def test_device_sets_one_device_first_and_only_allowed_sizes() -> None:
    four = rooms(1, 1, 1, 1)
    got = device_sets(four, sizes=frozenset({2, 4}))
    assert [len(s) for s in got] == [1] * 4 + [2] * 6 + [4]
    assert device_sets(four, splittable=False) == [(r,) for r in four]
    assert len(device_sets(rooms(*[1] * 8))) == 255


def test_fit_whole_evenly_or_by_layers() -> None:
    assert fit(5 * GiB, None, rooms(5)) is not None
    assert fit(5 * GiB, None, rooms(4.9)) is None
    even = fit(10 * GiB, None, rooms(5, 6))
    assert even is not None and even.device_bytes == ((0, 5 * GiB), (1, 5 * GiB))
    assert fit(10 * GiB, None, rooms(4, 20)) is None  # an even split overfills device 0
    assert fit(0, PROFILE, rooms(20, 17)) == split_layers(PROFILE, rooms(20, 17))


def test_fit_offloaded_without_a_profile_fills_in_order() -> None:
    p = fit_offloaded(30 * GiB, None, rooms(10, 12), host_free=8 * GiB)
    assert p is not None and p.device_bytes == ((0, 10 * GiB), (1, 12 * GiB))
    assert p.host_bytes == 8 * GiB and p.layers == ()
    assert fit_offloaded(30 * GiB, None, rooms(10, 12), host_free=7 * GiB) is None


def test_a_profile_scales_to_the_bytes_placed() -> None:
    """A load measured the model at more than its estimate: the split places what was measured,
    in the estimate's shape (the whole stays exact)."""
    from modelyard.placement.devices import LayerProfile

    profile = LayerProfile((2**30,) * 10, 2**20, 2**29, 2**28)
    whole = profile.bytes_on_one_device()
    scaled = profile.scaled_to(whole * 2)
    assert scaled.bytes_on_one_device() == whole * 2
    assert scaled.layer_bytes == (2**31,) * 10 and scaled.compute_bytes_per_device == 2**29
    assert profile.scaled_to(whole) is profile
