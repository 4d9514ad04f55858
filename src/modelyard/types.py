"""Small value types shared by the front, the engines and the device probes.

Kept free of heavy imports so every process (including the torch-free front) can use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


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


@dataclass(frozen=True)
class Lease:
    """A grant to send requests for `model` to `upstream` until released (DESIGN.md §3.3)."""

    id: str
    model: str
    upstream: str
    load_duration_ns: int

    def to_json(self) -> dict[str, Any]:
        return {
            "lease_id": self.id,
            "model": self.model,
            "upstream": self.upstream,
            "load_duration_ns": self.load_duration_ns,
        }
