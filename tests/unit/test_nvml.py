"""hw.nvml: the probe against a small fake NVML module (no GPU, no pynvml needed).

The fake implements the pynvml functions the probe calls, with canned values, and raises its own
NVMLError subclasses where real NVML does (unsupported sensors, empty MIG slots, no driver).
"""

from __future__ import annotations

import logging
import sys
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Any

import pytest

from modelyard.hw.nvml import NvmlProbe
from modelyard.types import DeviceInfo

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

GIB = 1024**3
MIB = 1024**2


class NVMLError(Exception):
    """pynvml's base class; the probe must only rely on this one."""


class NVMLError_NotSupported(NVMLError):  # pynvml's class names
    pass


class NVMLError_NotFound(NVMLError):
    pass


class NVMLError_InvalidArgument(NVMLError):
    pass


class NVMLError_Uninitialized(NVMLError):
    pass


class NVMLError_DriverNotLoaded(NVMLError):
    pass


class NVMLError_GpuIsLost(NVMLError):
    pass


# pynvml returns ctypes structures; only the attribute names matter to the probe.
Memory = namedtuple("Memory", "total free used")
Utilization = namedtuple("Utilization", "gpu memory")
ProcessInfo = namedtuple("ProcessInfo", "pid usedGpuMemory")


@dataclass
class FakeGpu:
    name: str | bytes
    uuid: str | bytes
    total: int
    used: int
    util: int | None = None  # None: NotSupported
    temp: int | None = None  # None: NotSupported
    procs: list[ProcessInfo] = field(default_factory=list)
    mig: list[FakeGpu] | None = None  # None: not MIG-capable; a list: MIG mode on
    lost: bool = False  # every query raises GpuIsLost


class FakeNvml:
    """The subset of pynvml that hw.nvml uses, over a list of FakeGpu."""

    NVMLError = NVMLError
    NVML_TEMPERATURE_GPU = 0
    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, gpus: list[FakeGpu], init_error: NVMLError | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.init_calls = 0
        self.shutdown_calls = 0
        self.initialized = False

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self._ready()
        self.shutdown_calls += 1
        self.initialized = False

    def _ready(self) -> None:
        if not self.initialized:
            raise NVMLError_Uninitialized("Uninitialized")

    def _gpu(self, handle: FakeGpu) -> FakeGpu:
        self._ready()
        if handle.lost:
            raise NVMLError_GpuIsLost("GPU is lost")
        return handle

    def nvmlDeviceGetCount(self) -> int:
        self._ready()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._ready()
        if not 0 <= index < len(self.gpus):
            raise NVMLError_InvalidArgument("Invalid Argument")
        return self.gpus[index]

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str | bytes:
        return self._gpu(handle).name

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str | bytes:
        return self._gpu(handle).uuid

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu) -> Memory:
        gpu = self._gpu(handle)
        return Memory(total=gpu.total, free=gpu.total - gpu.used, used=gpu.used)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGpu) -> Utilization:
        gpu = self._gpu(handle)
        if gpu.util is None:
            raise NVMLError_NotSupported("Not Supported")
        return Utilization(gpu=gpu.util, memory=0)

    def nvmlDeviceGetTemperature(self, handle: FakeGpu, sensor: int) -> int:
        gpu = self._gpu(handle)
        if sensor != self.NVML_TEMPERATURE_GPU:
            raise NVMLError_InvalidArgument("Invalid Argument")
        if gpu.temp is None:
            raise NVMLError_NotSupported("Not Supported")
        return gpu.temp

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGpu) -> list[ProcessInfo]:
        return list(self._gpu(handle).procs)

    def nvmlDeviceGetMigMode(self, handle: FakeGpu) -> list[int]:
        gpu = self._gpu(handle)
        if gpu.mig is None:
            raise NVMLError_NotSupported("Not Supported")
        return [1, 1]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeGpu) -> int:
        self._gpu(handle)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeGpu, index: int) -> FakeGpu:
        gpu = self._gpu(handle)
        if gpu.mig is None or index >= len(gpu.mig):
            raise NVMLError_NotFound("Not Found")
        return gpu.mig[index]


UUID0 = "GPU-5e3c1a2b-7f4d-2c9e-8b1a-3d6f9e0c4a57"
UUID1 = "GPU-a81f6c03-94b2-4e1d-b7c5-02e9d8f3a61c"


def two_gpus() -> list[FakeGpu]:
    return [
        # Old bindings (nvidia-ml-py < 11.515) return bytes.
        FakeGpu(b"NVIDIA GeForce RTX 4090", UUID0.encode(), 24 * GIB, 1 * GIB, util=7, temp=45,
                procs=[ProcessInfo(4242, 900 * MIB), ProcessInfo(4243, None)]),
        # A datacenter board without a readable temperature sensor.
        FakeGpu("Tesla T4", UUID1, 16 * GIB, 0, util=0, temp=None),
    ]


EXPECTED = [
    DeviceInfo(index=0, uuid=UUID0, name="NVIDIA GeForce RTX 4090", total_bytes=24 * GIB,
               used_bytes=1 * GIB, free_bytes=23 * GIB, utilization_pct=7, temperature_c=45),
    DeviceInfo(index=1, uuid=UUID1, name="Tesla T4", total_bytes=16 * GIB, used_bytes=0,
               free_bytes=16 * GIB, utilization_pct=0, temperature_c=None),
]


def test_two_gpus() -> None:
    probe = NvmlProbe(FakeNvml(two_gpus()))
    assert probe.available()
    assert probe.devices() == EXPECTED
    assert all(d.kind == "cuda" for d in probe.devices())


def test_unsupported_fields_are_none_not_zero() -> None:
    gpus = [FakeGpu("GPU without sensors", "GPU-x", 8 * GIB, 2 * GIB, util=None, temp=None)]
    (dev,) = NvmlProbe(FakeNvml(gpus)).devices()
    assert (dev.utilization_pct, dev.temperature_c) == (None, None)
    assert (dev.total_bytes, dev.used_bytes, dev.free_bytes) == (8 * GIB, 2 * GIB, 6 * GIB)


def test_processes_with_unknown_memory() -> None:
    probe = NvmlProbe(FakeNvml(two_gpus()))
    assert probe.processes(0) == {4242: 900 * MIB, 4243: 0}
    assert probe.processes(1) == {}


def test_processes_sum_a_pid_listed_twice() -> None:
    gpu = FakeGpu("g", "GPU-g", GIB, 0, procs=[ProcessInfo(7, 100), ProcessInfo(7, 50)])
    assert NvmlProbe(FakeNvml([gpu])).processes(0) == {7: 150}


def test_processes_of_a_missing_or_lost_gpu() -> None:
    gpus = two_gpus()
    gpus[1].lost = True
    probe = NvmlProbe(FakeNvml(gpus))
    assert probe.processes(5) == {}
    assert probe.processes(1) == {}


@pytest.mark.parametrize(
    ("visible", "expected_indices"),
    [
        (None, [0, 1]),
        ("1", [1]),
        ("0,1", [0, 1]),
        (" 1 , 0 ", [0, 1]),  # NVML order is kept, as in visible_gpus
        (UUID1, [1]),
        (f"{UUID0},1", [0, 1]),
        ("", []),  # CUDA_VISIBLE_DEVICES="" hides every GPU
        ("-1", []),
        ("7", []),
        ("GPU-not-here", []),
    ],
)
def test_visible_filter(visible: str | None, expected_indices: list[int]) -> None:
    probe = NvmlProbe(FakeNvml(two_gpus()))
    assert [d.index for d in probe.devices(visible)] == expected_indices


def test_visible_filter_keeps_nvml_indices_and_fields() -> None:
    probe = NvmlProbe(FakeNvml(two_gpus()))
    assert probe.devices(UUID1) == [EXPECTED[1]]


def test_init_failure(caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml(two_gpus(), init_error=NVMLError_DriverNotLoaded("Driver Not Loaded"))
    probe = NvmlProbe(nvml)
    with caplog.at_level(logging.WARNING, logger="modelyard.hw.nvml"):
        assert probe.available() is False
        assert probe.devices() == []
        assert probe.devices("0") == []
        assert probe.processes(0) == {}
        assert probe.temperature_c(0) is None
        probe.shutdown()  # nothing to release, must not raise
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # warned once, not on every poll
    assert "Driver Not Loaded" in warnings[0].getMessage()
    assert nvml.init_calls == 5  # retried: the driver may come up later
    assert nvml.shutdown_calls == 0


def test_init_is_retried_until_it_succeeds() -> None:
    nvml = FakeNvml(two_gpus(), init_error=NVMLError_DriverNotLoaded("Driver Not Loaded"))
    probe = NvmlProbe(nvml)
    assert probe.devices() == []
    nvml.init_error = None
    assert probe.devices() == EXPECTED
    assert probe.devices() == EXPECTED
    assert nvml.init_calls == 2  # initialized once, then kept


def test_missing_bindings(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    probe = NvmlProbe()
    with caplog.at_level(logging.INFO, logger="modelyard.hw.nvml"):
        assert probe.available() is False
        assert probe.devices() == []
        assert probe.processes(0) == {}
    # An optional extra: said once, at INFO (callers fall back to nvidia-smi).
    assert [(r.levelno, "modelyard[gpu]" in r.getMessage()) for r in caplog.records] == [
        (logging.INFO, True)
    ]


def test_a_lost_gpu_is_left_out() -> None:
    gpus = two_gpus()
    gpus[0].lost = True
    assert NvmlProbe(FakeNvml(gpus)).devices() == [EXPECTED[1]]


def test_count_failure_gives_no_devices() -> None:
    class NoCount(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            raise NVMLError_GpuIsLost("GPU is lost")

    assert NvmlProbe(NoCount(two_gpus())).devices() == []


def test_shutdown_releases_once_and_reinitializes_on_next_use() -> None:
    nvml = FakeNvml(two_gpus())
    probe = NvmlProbe(nvml)
    assert probe.available()
    probe.shutdown()
    probe.shutdown()
    assert nvml.shutdown_calls == 1
    assert probe.devices() == EXPECTED
    assert nvml.init_calls == 2


def test_temperature_reader() -> None:
    probe = NvmlProbe(FakeNvml(two_gpus()))
    assert probe.temperature_c(0) == 45
    assert probe.temperature_c(1) is None  # NotSupported
    assert probe.temperature_c(9) is None  # no such device


MIG0 = "MIG-1a2b3c4d-0000-5e6f-8a9b-0c1d2e3f4a5b"
MIG1 = "MIG-9f8e7d6c-1111-5b4a-8c3d-2e1f0a9b8c7d"
A100 = "GPU-0f1e2d3c-4b5a-6978-8a9b-abcdefabcdef"


def mig_gpus() -> list[FakeGpu]:
    instances = [
        # NVML names a MIG device after its profile; no utilization, no temperature per instance.
        FakeGpu("NVIDIA A100-SXM4-80GB MIG 3g.40gb", MIG0, 40 * GIB, 5 * GIB),
        FakeGpu("NVIDIA A100-SXM4-80GB MIG 3g.40gb", MIG1, 40 * GIB, 0),
    ]
    return [
        FakeGpu("NVIDIA A100-SXM4-80GB", A100, 80 * GIB, 5 * GIB, util=None, temp=34,
                mig=instances),
        FakeGpu("Tesla T4", UUID1, 16 * GIB, 0, util=0, temp=50, mig=None),
    ]


def test_mig_instances_replace_their_parent() -> None:
    devices = NvmlProbe(FakeNvml(mig_gpus())).devices()
    assert [(d.index, d.uuid) for d in devices] == [(0, MIG0), (0, MIG1), (1, UUID1)]
    first = devices[0]
    assert first.name == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    assert (first.total_bytes, first.used_bytes, first.free_bytes) == (40 * GIB, 5 * GIB, 35 * GIB)
    assert first.utilization_pct is None
    assert first.temperature_c == 34  # the parent's die sensor


@pytest.mark.parametrize(
    ("visible", "expected_uuids"),
    [
        (MIG1, [MIG1]),
        ("0", [MIG0, MIG1]),  # the parent's index selects all its instances
        (A100, [MIG0, MIG1]),  # so does its GPU UUID
        (f"{MIG0},1", [MIG0, UUID1]),
    ],
)
def test_mig_visible_filter(visible: str, expected_uuids: list[str]) -> None:
    devices = NvmlProbe(FakeNvml(mig_gpus())).devices(visible)
    assert [d.uuid for d in devices] == expected_uuids


def test_mig_mode_without_instances_reports_the_parent() -> None:
    gpus = mig_gpus()
    gpus[0].mig = []
    (a100, _) = NvmlProbe(FakeNvml(gpus)).devices()
    assert (a100.uuid, a100.total_bytes, a100.temperature_c) == (A100, 80 * GIB, 34)


def test_bindings_without_mig_functions_report_the_parent() -> None:
    class OldNvml(FakeNvml):
        nvmlDeviceGetMigMode: Any = None  # the probe looks functions up with getattr

    (a100, _) = NvmlProbe(OldNvml(mig_gpus())).devices()
    assert a100.uuid == A100
