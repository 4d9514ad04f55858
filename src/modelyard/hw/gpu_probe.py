"""The GPU an engine owns, read through NVML when the bindings are there, else nvidia-smi.

GpuDevice is one of the engine ledger's devices (engine/ledger.py `Device`); it lives here so
that hw/ imports nothing above it. Only engines import this (NVML must stay out of the front);
`pynvml` itself is imported lazily by hw/nvml.py, so a host without the `gpu` extra still gets
nvidia-smi readings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from modelyard.hw.devices import visible_gpus
from modelyard.hw.nvml import NvmlProbe
from modelyard.hw.smi import query_gpus
from modelyard.types import DeviceInfo

log = logging.getLogger("modelyard.hw")


class GpuDevice:
    """A real GPU read through a probe (NVML in engines, nvidia-smi as the fallback)."""

    kind = "cuda"

    def __init__(
        self,
        read: Callable[[], DeviceInfo | None],
        processes: Callable[[], Mapping[int, int]],
        fallback_total_bytes: int = 0,
    ) -> None:
        self._read = read
        self._processes = processes
        self._last: DeviceInfo | None = None
        self._fallback_total = fallback_total_bytes

    def info(self) -> DeviceInfo:
        info = self._read()
        if info is not None:
            self._last = info
            return info
        # The driver did not answer this time: the last reading, or an empty device.
        return self._last or DeviceInfo(0, None, "gpu (unreadable)", self._fallback_total,
                                        None, None, None, None)

    def used_by(self, pids: Iterable[int]) -> dict[int, int]:
        procs = self._processes()
        return {pid: procs[pid] for pid in pids if pid in procs}

    def child_env(self) -> dict[str, str]:
        return {}  # CUDA_VISIBLE_DEVICES is already the engine's own

    def on_spawn(self, pid: int, reserved_bytes: int) -> None:
        pass


def gpu_devices_for(cuda_visible: str | None) -> list[tuple[int, GpuDevice]]:
    """Every GPU `cuda_visible` names (an engine's device group), by physical index."""
    probe = NvmlProbe()
    if probe.available():
        found = [(d.index, gpu_device_for(str(d.index))) for d in probe.devices(cuda_visible)]
    else:
        found = [(d.index, gpu_device_for(str(d.index)))
                 for d in visible_gpus(query_gpus(), cuda_visible)]
    return [(i, g) for i, g in found if g is not None]


def gpu_device_for(cuda_visible: str | None) -> GpuDevice | None:
    """The first GPU `cuda_visible` names, or None when there is none."""
    probe = NvmlProbe()
    if probe.available():
        gpus = probe.devices(cuda_visible)
        if not gpus:
            return None
        index = gpus[0].index

        def read_nvml() -> DeviceInfo | None:
            found = [d for d in probe.devices(cuda_visible) if d.index == index]
            return found[0] if found else None

        def processes() -> Mapping[int, int]:
            return probe.processes(index)

        return GpuDevice(read_nvml, processes, gpus[0].total_bytes)

    first = visible_gpus(query_gpus(), cuda_visible)
    if not first:
        return None
    log.info("NVML bindings unavailable (install modelyard[gpu]); reading nvidia-smi instead")
    index = first[0].index

    def read_smi() -> DeviceInfo | None:
        found = [d for d in query_gpus() if d.index == index]
        return found[0] if found else None

    # nvidia-smi's per-process figures need another query; without NVML the engine relies on
    # device totals, which is what recovery waits on anyway.
    return GpuDevice(read_smi, dict, first[0].total_bytes)
