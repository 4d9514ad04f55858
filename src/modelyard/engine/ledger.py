"""The engine's device and its memory ledger: what the device reports vs what the engine promised.

A device reports total and free memory and what each process uses (simulated claims, NVML's
process list, or resident memory for the CPU engine). The ledger adds what the device cannot
know yet: the memory a model that is still loading will take (`Loading`, `plannable_free`: pure,
in placement/ledger.py, since the front plans with them too). After an unload the engine waits
until the device really reports the memory back (DESIGN.md §3.7), bounded, before it re-plans.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import psutil

from modelyard.hw.simulated import CLAIMS_DIR_ENV, SimulatedGpu

# Re-exported: the engine's callers (and tests) know them from here.
from modelyard.placement.ledger import Loading as Loading
from modelyard.placement.ledger import plannable_free as plannable_free
from modelyard.types import DeviceInfo

log = logging.getLogger("modelyard.engine.ledger")


class Device(Protocol):
    """One device an engine owns (an engine owns a group of them: engine/device_group.py)."""

    kind: str

    def info(self) -> DeviceInfo: ...

    def used_by(self, pids: Iterable[int]) -> dict[int, int]:
        """Bytes each of `pids` holds on the device now (absent: holds nothing / is gone)."""
        ...

    def child_env(self) -> dict[str, str]:
        """Environment for children that run on this device."""
        ...

    def on_spawn(self, pid: int, reserved_bytes: int) -> None:
        """A child was started for a model that should take `reserved_bytes`."""
        ...


class SimulatedDevice:
    kind = "simulated"

    def __init__(self, gpu: SimulatedGpu, temperature_c: Callable[[], int | None] | None = None):
        self.gpu = gpu
        self.index = gpu.index
        self._temperature = temperature_c or (lambda: None)
        gpu.reset()

    def info(self) -> DeviceInfo:
        return self.gpu.info(self._temperature())

    def used_by(self, pids: Iterable[int]) -> dict[int, int]:
        claims = self.gpu.used_by_pid()
        return {pid: claims[pid] for pid in pids if pid in claims}

    def child_env(self) -> dict[str, str]:
        return {CLAIMS_DIR_ENV: str(self.gpu.claims_dir), "CUDA_VISIBLE_DEVICES": ""}

    def on_spawn(self, pid: int, reserved_bytes: int) -> None:
        self.gpu.claim_stand_in(pid, reserved_bytes)


def _rss(pid: int) -> int | None:
    try:
        proc = psutil.Process(pid)
        return sum(p.memory_info().rss for p in (proc, *proc.children(recursive=True)))
    except psutil.Error:
        return None


class HostDevice:
    """The CPU engine's device: host RAM, optionally capped server-wide (`host_ram_cap_bytes`)."""

    kind = "cpu"
    index = 0

    def __init__(self, cap_bytes: int | None, children: Callable[[], Iterable[int]]) -> None:
        self.cap_bytes = cap_bytes
        self._children = children
        # What the engine holds of the host beyond its children: its warm tier (set by the
        # engine, engine/warm_tier.py), counted against the cap like a child's memory.
        self.held_elsewhere: Callable[[], int] = lambda: 0

    def info(self) -> DeviceInfo:
        mem = psutil.virtual_memory()
        total, free = mem.total, mem.available
        if self.cap_bytes is not None:
            held = sum(self.used_by(self._children()).values()) + self.held_elsewhere()
            total = min(total, self.cap_bytes)
            free = max(0, min(free, total - held))
        return DeviceInfo(
            index=0,
            uuid=None,
            name=f"cpu ({psutil.cpu_count() or 1} cores)",
            total_bytes=total,
            used_bytes=total - free,
            free_bytes=free,
            utilization_pct=round(psutil.cpu_percent(interval=None)),
            temperature_c=None,
            kind="cpu",
        )

    def used_by(self, pids: Iterable[int]) -> dict[int, int]:
        out = {}
        for pid in pids:
            rss = _rss(pid)
            if rss is not None:
                out[pid] = rss
        return out

    def child_env(self) -> dict[str, str]:
        return {}

    def on_spawn(self, pid: int, reserved_bytes: int) -> None:
        pass




def host_memory() -> tuple[int, int]:
    """The host's available and total RAM (what the warm tier may fill, on any engine)."""
    mem = psutil.virtual_memory()
    return mem.available, mem.total


async def wait_for_recovery(
    device: Device,
    gone_pids: set[int],
    want_free_bytes: int,
    timeout_s: float,
    *,
    poll_s: float = 0.05,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Wait until the device no longer counts `gone_pids` and reports `want_free_bytes` free.

    Drivers release a dead process's memory asynchronously; loading before it is back is how a
    swap ends in an out-of-memory error. Bounded: False (and a warning) when it never came back.
    """
    deadline = clock() + timeout_s
    while True:
        info = device.info()
        holding = device.used_by(gone_pids)
        free = info.free_bytes if info.free_bytes is not None else want_free_bytes
        if not holding and free >= want_free_bytes:
            return True
        if clock() >= deadline:
            log.warning(
                "memory not back after %.0f s: %d bytes free of %d wanted; pids still holding: %s",
                timeout_s, free, want_free_bytes, sorted(holding),
            )
            return False
        await asyncio.sleep(poll_s)


def simulated_device(index: int, total_bytes: int, home: Path) -> SimulatedDevice:
    return SimulatedDevice(SimulatedGpu(index, total_bytes, home / "run" / "simgpu" / str(index)))
