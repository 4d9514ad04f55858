"""The ledger arithmetic both ends plan with (the device side lives in engine/ledger.py).

A device cannot know yet what a model that is still loading will take, so planning uses

    free for planning = free as reported - Σ over loading models (reserved - already measured)

and two loads started together never promise the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Loading", "plannable_free"]


@dataclass(frozen=True)
class Loading:
    """A model being loaded: what it was promised and what the device shows of it so far."""

    reserved_bytes: int
    measured_bytes: int


def plannable_free(device_free: int, loading: Iterable[Loading]) -> int:
    """Free memory for planning: the device's, less what loading models will still take."""
    pending = sum(max(0, ld.reserved_bytes - ld.measured_bytes) for ld in loading)
    return max(0, device_free - pending)
