"""Which devices each engine owns (config `engine_devices`), pure: the front plans its engine
processes with it (front/engines/supervisor.py) and each engine finds its own group with it
(engine/ledger.py), so both ends agree on what engine N owns."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

__all__ = ["device_groups"]

EngineDevices = Literal["per_gpu", "per_node"] | list[list[int]]


def device_groups(engine_devices: EngineDevices, gpus: Sequence[int]) -> list[list[int]]:
    """The device indexes of each engine, engine index = position: `per_node` one group of
    every GPU, `per_gpu` one group per GPU, explicit groups as given. No GPU: no group (the
    caller runs one CPU engine). An explicit group naming a GPU that is not there is an error,
    not a silently smaller group: the user's layout would not be what runs."""
    if not gpus:
        return []
    if engine_devices == "per_node":
        return [list(gpus)]
    if engine_devices == "per_gpu":
        return [[g] for g in gpus]
    missing = sorted({i for group in engine_devices for i in group} - set(gpus))
    if missing:
        raise ValueError(f"engine_devices names GPU {missing[0]}, but the GPUs here are "
                         f"{list(gpus)}")
    return [list(group) for group in engine_devices]
