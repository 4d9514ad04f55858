from typing import Any

import pytest
from pydantic import ValidationError

from modelyard.config import Settings
from modelyard.front.engines.supervisor import EnginePlan, plan_engines
from modelyard.hw.devices import visible_gpus
from modelyard.types import DeviceInfo

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def _gpu(i: int) -> DeviceInfo:
    return DeviceInfo(i, f"GPU-{i}", "test", 24 << 30, 0, 24 << 30, 0, 40)


@pytest.mark.parametrize(
    ("devices", "engine_devices", "gpus", "plans"),
    [
        ("auto", "per_node", 0, [EnginePlan(0, "")]),  # no GPU: one CPU engine that sees none
        ("auto", "per_node", 2, [EnginePlan(0, "0,1")]),  # the default: one engine, all GPUs
        ("auto", "per_gpu", 2, [EnginePlan(0, "0"), EnginePlan(1, "1")]),
        ("auto", [[2, 3], [0, 1]], 4, [EnginePlan(0, "2,3"), EnginePlan(1, "0,1")]),
        ("cpu", "per_node", 2, [EnginePlan(0, "")]),
    ],
)
def test_one_engine_per_device_group(
    devices: str, engine_devices: Any, gpus: int, plans: list[EnginePlan]
) -> None:
    settings = Settings(devices=devices, engine_devices=engine_devices)  # type: ignore[arg-type]
    assert plan_engines(settings, gpus) == plans


@pytest.mark.parametrize(("engine_devices", "engines"), [("per_node", 1), ("per_gpu", 2)])
def test_simulated_gpus_are_grouped_the_same_way(engine_devices: str, engines: int) -> None:
    settings = Settings(simulate_gpus="2x24GiB", engine_devices=engine_devices)  # type: ignore[arg-type]
    assert plan_engines(settings, 2) == [EnginePlan(i, "") for i in range(engines)]


def test_a_group_naming_a_missing_gpu_is_an_error() -> None:
    with pytest.raises(ValueError, match="names GPU 2, but the GPUs here are"):
        plan_engines(Settings(engine_devices=[[0], [2]]), 2)


@pytest.mark.parametrize(
    ("engine_devices", "simulate", "message"),
    [
        ([[0, 1], [1]], None, "GPU 1 is in two groups"),
        ([[0, 0]], None, "GPU 0 is in two groups"),
        ([[]], None, "an empty group"),
        ([[0], [2]], "2x8GiB", "no GPU 2"),
    ],
)
def test_engine_devices_is_validated(engine_devices: Any, simulate: str | None,
                                     message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(engine_devices=engine_devices, simulate_gpus=simulate)


@pytest.mark.parametrize(
    ("cuda_visible", "expected"),
    [(None, [0, 1, 2]), ("", []), ("1", [1]), ("2,0", [0, 2]), ("GPU-1", [1]), (" 0 , 9", [0])],
)
def test_cuda_visible_devices(cuda_visible: str | None, expected: list[int]) -> None:
    gpus = [_gpu(i) for i in range(3)]
    assert [g.index for g in visible_gpus(gpus, cuda_visible)] == expected
