"""What devices this process can use: the GPUs nvidia-smi reports, or the host CPU and RAM.

Light on purpose (no NVML bindings): the front uses it to decide how many engines to start, and an
engine uses it for /diag, restricted to the GPUs its CUDA_VISIBLE_DEVICES names.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import psutil

from modelyard.hw.smi import query_gpus
from modelyard.types import DeviceInfo


def host_device() -> DeviceInfo:
    mem = psutil.virtual_memory()
    return DeviceInfo(
        index=0,
        uuid=None,
        name=f"cpu ({psutil.cpu_count() or 1} cores)",
        total_bytes=mem.total,
        used_bytes=mem.total - mem.available,
        free_bytes=mem.available,
        utilization_pct=round(psutil.cpu_percent(interval=None)),
        temperature_c=None,
        kind="cpu",
    )


def visible_gpus(gpus: list[DeviceInfo], cuda_visible: str | None) -> list[DeviceInfo]:
    """The GPUs a CUDA_VISIBLE_DEVICES value (indices or UUIDs) lets a process see."""
    if cuda_visible is None:
        return gpus
    wanted = [w.strip() for w in cuda_visible.split(",") if w.strip()]
    return [g for g in gpus if str(g.index) in wanted or (g.uuid is not None and g.uuid in wanted)]


def env_with_visible(visible: str | None) -> dict[str, str]:
    """This process's environment for a child probe that must see exactly `visible`'s GPUs
    (None: whatever the child would see by default)."""
    env = dict(os.environ)
    if visible is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def describe_devices() -> list[dict[str, Any]]:
    gpus = visible_gpus(query_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    return [asdict(d) for d in (gpus or [host_device()])]
