"""placement/view.py over several devices: the front plans per device from an engine's status
(one room per device, less what loading models still take on it) and offloads into the host
RAM the engine reported, after a trip through the wire types."""

from __future__ import annotations

import orjson
import pytest

from modelyard.placement import policy as scheduler
from modelyard.placement import view
from modelyard.placement.devices import DeviceRoom, LayerProfile, Placement, split_evenly
from modelyard.wire.status import DeviceStatus, EngineStatus, ModelMemory, ModelStatus

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

GiB = 2**30


def device(index: int, free: float, total: float = 24) -> DeviceStatus:
    return DeviceStatus(kind="simulated", total_bytes=int(total * GiB),
                        free_bytes=int(free * GiB), index=index)


def model(name: str, state: str, reserved: float, measured: float | None,
          placement: Placement | None, **kw: object) -> ModelStatus:
    memory = ModelMemory(reserved_bytes=int(reserved * GiB),
                         measured_bytes=None if measured is None else int(measured * GiB))
    return ModelStatus(model=name, state=state, memory=memory, placement=placement,
                       **kw)  # type: ignore[arg-type]


def status(*devices: DeviceStatus, models: tuple[ModelStatus, ...] = (),
           host: DeviceStatus | None = None, warm: float = 0) -> EngineStatus:
    total = DeviceStatus(total_bytes=sum(d.total_bytes for d in devices),
                         free_bytes=sum(d.free_bytes or 0 for d in devices),
                         warm_bytes=int(warm * GiB))
    built = EngineStatus(device=total, devices=devices, models=models, host=host)
    return EngineStatus.from_json(orjson.loads(orjson.dumps(built.to_json())))


def test_a_loading_model_holds_its_pending_bytes_on_its_own_device() -> None:
    # b loads on device 1: promised 20, 4 measured so far → 16 more to come there
    loading = model("b", "loading", 20, 4, Placement.whole(1, 20 * GiB))
    st = status(device(0, 14), device(1, 20), models=(loading,))
    assert view.device_rooms(st) == (DeviceRoom(0, 14 * GiB, 24 * GiB),
                                     DeviceRoom(1, 4 * GiB, 24 * GiB))
    got = view.plan_from_status(st, scheduler.Want("c", 12 * GiB, splittable=False))
    assert isinstance(got, scheduler.Load) and got.placement == Placement.whole(0, 12 * GiB)
    # the sum alone (34 GiB free less 16) would have said device 1 has room for 16
    got = view.plan_from_status(st, scheduler.Want("d", 16 * GiB, splittable=False))
    assert isinstance(got, scheduler.Wait) and got.blocked_by == ("b",)


def test_a_spanning_loading_model_holds_on_each_device() -> None:
    loading = model("b", "loading", 20, 10, split_evenly(20 * GiB, [0, 1]))
    st = status(device(0, 14), device(1, 14), models=(loading,))
    assert view.device_rooms(st) == (DeviceRoom(0, 9 * GiB, 24 * GiB),
                                     DeviceRoom(1, 9 * GiB, 24 * GiB))


def test_warm_bytes_count_on_the_first_device() -> None:
    st = status(device(2, 4), device(3, 6), warm=8)
    assert [r.free_bytes for r in view.device_rooms(st)] == [12 * GiB, 6 * GiB]


def test_a_ready_spanning_victim_frees_both_and_holds_what_was_measured() -> None:
    # promised 40 over both, measured 44: it frees 22 on each
    ready = model("x", "ready", 40, 44, split_evenly(40 * GiB, [0, 1]))
    st = status(device(0, 2), device(1, 2), models=(ready,))
    (resident,) = view.residents(st.models)
    assert resident.placement == split_evenly(44 * GiB, [0, 1])
    got = view.plan_from_status(st, scheduler.Want("m", 46 * GiB))
    assert isinstance(got, scheduler.Evict) and got.victims == ("x",)
    assert got.placement == split_evenly(46 * GiB, [0, 1])


def test_offload_uses_the_host_room_the_engine_reported() -> None:
    profile = LayerProfile((GiB,) * 56, 0, 2 * GiB, GiB)
    host = DeviceStatus(kind="host", total_bytes=128 * GiB, free_bytes=64 * GiB)
    st = status(device(0, 24), device(1, 24), host=host)
    want = scheduler.Want("m", 59 * GiB, profile=profile, offload=True)  # the profile's whole
    got = view.plan_from_status(st, want)
    assert isinstance(got, scheduler.Load) and got.placement is not None
    assert got.placement.host_bytes == 12 * GiB and got.placement.layers == (21, 23)
    # offload off: the same status says NoFit
    got = view.plan_from_status(st, scheduler.Want("m", 59 * GiB, profile=profile))
    assert isinstance(got, scheduler.NoFit)


def test_without_devices_the_status_plans_on_one_device() -> None:
    st = EngineStatus(device=DeviceStatus(total_bytes=8 * GiB, free_bytes=6 * GiB))
    got = view.plan_from_status(st, scheduler.Want("c", 5 * GiB))
    assert got == scheduler.Load("c")
    assert isinstance(got, scheduler.Load) and got.placement == Placement.whole(0, 5 * GiB)
