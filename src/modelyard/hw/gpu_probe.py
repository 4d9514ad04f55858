"""The GPU an engine owns, read through NVML when the bindings are there, else nvidia-smi.

Only engines import this (NVML must stay out of the front); `pynvml` itself is imported lazily by
hw/nvml.py, so a host without the `gpu` extra still gets nvidia-smi readings.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from modelyard.engine.ledger import GpuDevice
from modelyard.hw.devices import visible_gpus
from modelyard.hw.nvml import NvmlProbe
from modelyard.hw.smi import query_gpus
from modelyard.types import DeviceInfo

log = logging.getLogger("modelyard.hw")


def gpu_device_for(cuda_visible: str | None) -> GpuDevice | None:
    """The first GPU `cuda_visible` names (an engine owns one), or None when there is none."""
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
