"""Where transformers puts a placement's load: accelerate's `device_map` and `max_memory`.

Pure (no torch): the loader passes the result to `from_pretrained`. The transformers backend
runs inside the engine, so it sees the engine's whole group (its CUDA_VISIBLE_DEVICES), not
only the placement's devices as a child does: a placement's device (a physical index) becomes
its CUDA ordinal by its position among the visible ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from modelyard.placement.devices import Placement

__all__ = ["device_map_kwargs", "visible_indexes"]


def visible_indexes(cuda_visible: str | None, count: int) -> list[int]:
    """The physical indexes CUDA ordinals 0..count-1 stand for: CUDA_VISIBLE_DEVICES's list
    when it names indexes, else (unset, or UUIDs) the ordinals themselves."""
    if cuda_visible is not None:
        parts = [p.strip() for p in cuda_visible.split(",") if p.strip()]
        if parts and all(p.isdigit() for p in parts):
            return [int(p) for p in parts][:count]
    return list(range(count))


def device_map_kwargs(placement: Placement | None, visible: Sequence[int]) -> dict[str, Any]:
    """`from_pretrained` keywords for `placement` over the `visible` GPUs (physical indexes in
    CUDA order; empty on a CPU engine).

    * no placement, or no GPU: {} (the loader keeps its default: CPU, or the first GPU);
    * one device, nothing in host RAM: `device_map={"": ordinal}`, the whole model there;
    * several devices, or layers left in host RAM: `device_map="auto"` with `max_memory` per
      ordinal from the placement's bytes and `"cpu"` its host bytes (0: nothing may spill to
      host RAM behind the ledger's back; accelerate then fails the load rather than running
      slowly on memory no one counted).
    """
    if placement is None or not placement.devices or not visible:
        return {}
    ordinals = [visible.index(d) if d in visible else i
                for i, d in enumerate(placement.devices)]
    if len(ordinals) == 1 and not placement.offloaded:
        return {"device_map": {"": ordinals[0]}}
    max_memory: dict[int | str, int] = {
        o: b for o, (_, b) in zip(ordinals, placement.device_bytes, strict=True)}
    max_memory["cpu"] = placement.host_bytes
    return {"device_map": "auto", "max_memory": max_memory}
