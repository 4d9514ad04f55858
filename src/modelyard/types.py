"""Small value types shared by the front, the engines and the device probes.

Kept free of heavy imports so every process (including the torch-free front) can use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class DeviceInfo:
    """One accelerator (or the CPU stand-in) as a probe saw it at one moment.

    Figures a probe could not read are None rather than 0, so "unknown" is never mistaken for
    "empty" or "idle" by the placement policy.
    """

    index: int
    uuid: str | None
    name: str
    total_bytes: int
    used_bytes: int | None
    free_bytes: int | None
    utilization_pct: int | None
    temperature_c: int | None
    kind: Literal["cuda", "cpu", "simulated"] = "cuda"
