"""An engine's device group: sums, per-device readings and claims, a placement's child env."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from modelyard.config import Settings
from modelyard.engine.device_group import DeviceGroup, engine_group, make_device
from modelyard.engine.ledger import SimulatedDevice
from modelyard.engine.state import measured_placement
from modelyard.hw.simulated import CLAIM_SPLIT_ENV, CLAIMS_DIR_ENV, SimulatedGpu, split_claim
from modelyard.placement.devices import Placement
from modelyard.types import DeviceInfo

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]

GIB = 2**30
FAKE = Path(__file__).resolve().parents[1] / "fakes" / "fake_backend.py"


@pytest.fixture
def group(tmp_path: Path) -> DeviceGroup:
    return DeviceGroup([(i, SimulatedDevice(SimulatedGpu(i, 24 * GIB, tmp_path / str(i))))
                        for i in (0, 1)])


@pytest.fixture
def proc() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                         stdin=subprocess.PIPE)
    yield p
    p.kill()
    p.wait()


def test_the_group_sums_its_devices_and_reads_each(group: DeviceGroup) -> None:
    info = group.info()
    assert (info.total_bytes, info.free_bytes) == (48 * GIB, 48 * GIB)
    assert [i.index for i in group.infos()] == [0, 1]
    rooms = group.rooms({1: 4 * GIB})
    assert [(r.index, r.free_bytes) for r in rooms] == [(0, 24 * GIB), (1, 20 * GIB)]


def test_stand_in_claims_go_to_each_device_of_the_placement(
    group: DeviceGroup, proc: subprocess.Popen[bytes]
) -> None:
    placement = Placement(device_bytes=((0, 10 * GIB), (1, 6 * GIB)))
    group.on_spawn(proc.pid, 16 * GIB, placement)
    assert group.used_by_device([proc.pid]) == {0: {proc.pid: 10 * GIB},
                                                1: {proc.pid: 6 * GIB}}
    assert group.used_by([proc.pid]) == {proc.pid: 16 * GIB}
    assert group.info().free_bytes == 32 * GIB


def test_a_childs_env_names_its_placements_claim_dirs_in_order(group: DeviceGroup) -> None:
    env = group.child_env(Placement(device_bytes=((1, 3), (0, 1))))
    dirs = env[CLAIMS_DIR_ENV].split(os.pathsep)
    assert [Path(d).name for d in dirs] == ["1", "0"]
    assert env[CLAIM_SPLIT_ENV] == "3,1"
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    one = group.child_env(Placement.whole(1, 5))
    assert Path(one[CLAIMS_DIR_ENV]).name == "1" and CLAIM_SPLIT_ENV not in one


def test_the_fake_backend_claims_per_device_as_the_split_says(
    group: DeviceGroup, tmp_path: Path
) -> None:
    env = {**os.environ, **group.child_env(Placement(device_bytes=((0, 3 * GIB), (1, GIB))))}
    code = ("import runpy, sys; sys.argv=['fake']; "
            f"m = runpy.run_path({str(FAKE)!r}); m['claim_memory']({8 * GIB}); "
            "print('claimed', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None
        assert p.stdout.readline() == b"claimed\n"  # its claims are filed
        assert group.used_by_device([p.pid]) == {0: {p.pid: 6 * GIB}, 1: {p.pid: 2 * GIB}}
    finally:
        p.kill()
        p.wait()
    assert group.used_by([p.pid]) == {}  # gone: its memory is back on both


@pytest.mark.parametrize(
    ("nbytes", "parts", "weights", "expected"),
    [(10, 2, None, [5, 5]), (11, 2, None, [6, 5]), (8, 2, "3,1", [6, 2]),
     (9, 2, "bad", [5, 4]), (9, 3, "1,1", [3, 3, 3]),
     (10, 2, "2,2,1", [4, 4]),  # a last weight is host RAM: no device claims it
     (10, 1, "3,2", [6])],
)
def test_split_claim(nbytes: int, parts: int, weights: str | None, expected: list[int]) -> None:
    assert split_claim(nbytes, parts, weights) == expected


def test_an_engine_finds_its_simulated_group(tmp_path: Path) -> None:
    node = Settings(home=tmp_path, simulate_gpus="2x24GiB")
    assert engine_group(node, 0) == [0, 1]
    assert make_device(node, 0, list).indexes == (0, 1)
    per_gpu = Settings(home=tmp_path, simulate_gpus="2x24GiB", engine_devices="per_gpu")
    assert engine_group(per_gpu, 1) == [1]
    assert make_device(per_gpu, 1, list).info().total_bytes == 24 * GIB


async def test_recovery_waits_for_every_device_a_victim_spanned(
    group: DeviceGroup, proc: subprocess.Popen[bytes]
) -> None:
    group.on_spawn(proc.pid, 0, Placement(device_bytes=((0, 20 * GIB), (1, 20 * GIB))))
    assert not await group.wait_for_recovery({proc.pid}, {0: 20 * GIB, 1: 20 * GIB}, 0.1)
    proc.kill()
    proc.wait()
    assert await group.wait_for_recovery({proc.pid}, {0: 20 * GIB, 1: 20 * GIB}, 5)


class _Gpu:
    """A stand-in real GPU: what GpuDevice answers, from fixed numbers."""

    kind = "cuda"

    def __init__(self, index: int) -> None:
        self.index = index

    def info(self) -> DeviceInfo:
        return DeviceInfo(self.index, None, f"gpu {self.index}", 24 * GIB, 0, 24 * GIB, 0, 40)

    def used_by(self, pids: Iterable[int]) -> dict[int, int]:
        return {}

    def child_env(self) -> dict[str, str]:
        return {}

    def on_spawn(self, pid: int, reserved_bytes: int) -> None:
        pass


def test_a_real_gpu_child_sees_its_placements_devices_by_physical_index() -> None:
    group = DeviceGroup([(2, _Gpu(2)), (3, _Gpu(3))])
    env = group.child_env(Placement(device_bytes=((3, 1), (2, 1))))
    assert env == {"CUDA_VISIBLE_DEVICES": "3,2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert group.child_env(Placement.whole(3, 1))["CUDA_VISIBLE_DEVICES"] == "3"
    assert group.info().temperature_c == 40 and group.info().total_bytes == 48 * GIB


def test_measured_bytes_per_device_replace_the_estimate_and_keep_the_host_part() -> None:
    placed = Placement(device_bytes=((0, 10), (1, 10)), host_bytes=5, layers=(4, 4),
                       total_layers=10)
    measured = measured_placement(placed, {0: 12, 1: 9})
    assert measured is not None
    assert measured.device_bytes == ((0, 12), (1, 9))
    assert (measured.host_bytes, measured.layers) == (5, (4, 4))
    assert measured_placement(placed, {}) is placed
