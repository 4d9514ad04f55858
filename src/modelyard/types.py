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
    # The key `upstream` was started with for this load (DESIGN.md §3.12): whoever calls it
    # sends `Authorization: Bearer <api_key>`. None: a server that takes no key (a registered
    # service modelyard does not start, a user's argv template without `$api_key_file`).
    api_key: str | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "lease_id": self.id,
            "model": self.model,
            "upstream": self.upstream,
            "load_duration_ns": self.load_duration_ns,
        }
        if self.api_key is not None:
            d["api_key"] = self.api_key
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Lease:
        key = d.get("api_key")
        return cls(id=str(d["lease_id"]), model=str(d["model"]), upstream=str(d["upstream"]),
                   load_duration_ns=int(d["load_duration_ns"]),
                   api_key=str(key) if key is not None else None)
