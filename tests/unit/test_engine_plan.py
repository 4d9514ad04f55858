import pytest

from modelyard.config import Settings
from modelyard.front.engines.supervisor import EnginePlan, plan_engines
from modelyard.hw.devices import visible_gpus
from modelyard.types import DeviceInfo

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def _gpu(i: int) -> DeviceInfo:
    return DeviceInfo(i, f"GPU-{i}", "test", 24 << 30, 0, 24 << 30, 0, 40)


@pytest.mark.parametrize(
    ("devices", "gpus", "plans"),
    [
        ("auto", 0, [EnginePlan(0, "")]),  # no GPU: one CPU engine that sees none
        ("auto", 2, [EnginePlan(0, "0"), EnginePlan(1, "1")]),
        ("cpu", 2, [EnginePlan(0, "")]),
    ],
)
def test_one_engine_per_gpu(devices: str, gpus: int, plans: list[EnginePlan]) -> None:
    assert plan_engines(Settings(devices=devices), gpus) == plans  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cuda_visible", "expected"),
    [(None, [0, 1, 2]), ("", []), ("1", [1]), ("2,0", [0, 2]), ("GPU-1", [1]), (" 0 , 9", [0])],
)
def test_cuda_visible_devices(cuda_visible: str | None, expected: list[int]) -> None:
    gpus = [_gpu(i) for i in range(3)]
    assert [g.index for g in visible_gpus(gpus, cuda_visible)] == expected
