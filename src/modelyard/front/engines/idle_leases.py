"""Leases a front gave back a moment ago, kept for its next request for the same model.

Every request takes a lease from its model's engine and gives it back when its answer ends
(DESIGN.md §3.3): two frames on the lease channel and a wake of the engine's loop per request,
at many short requests the largest cost the engine has. A lease given back is held here for
`LINGER_S` instead; the front's next request for that model (with the same keep-alive) takes it
without a frame. What bounds what that changes on the engine's side:

- a lease is kept only while no request waits at the engine for a slot of its model: a grant
  made while others wait says so (`busy`) and is never kept, and a request that starts waiting
  makes the engine tell every front holding leases (`Wanted`), which gives back the model's kept
  leases at once and its leases in use when their requests end. So the engine's queue order
  (first come, or fair between owners and by priority under `serve --workers N`) holds: a kept
  lease never goes to a request that came after one waiting at the engine;
- a lease is reused only within `REUSE_SPAN_S` of its grant: after that it goes back for real
  (the engine's keep-alive and idle accounting see it);
- an idle model's lease goes back within `LINGER_S`: its keep-alive timer and an eviction that
  needs it idle start at most that much later;
- `keep_alive_s: 0` (unload at once) is never kept;
- any change of the engine's models (a State frame: a load, an unload, a crash, a reload) gives
  every kept lease back at once, so none is reused for an upstream that may be gone;
- a closed or silent channel forgets them (the engine releases a closed channel's leases).

A reused lease says it loaded nothing (`load_duration_ns` 0): the load was the first grant's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace

from modelyard.types import Lease

LINGER_S = 0.02
REUSE_SPAN_S = 0.2

_Key = tuple[str, float | None]  # (model, keep_alive_s asked)


class IdleLeases:
    def __init__(
        self,
        release: Callable[[str], None],
        *,
        linger_s: float = LINGER_S,
        span_s: float = REUSE_SPAN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._release = release  # gives a lease back to the engine (a Release frame)
        self._linger_s = linger_s
        self._span_s = span_s
        self._clock = clock
        self._granted: dict[str, tuple[_Key, float]] = {}  # lease id → (key, grant time)
        self._parked: dict[_Key, list[tuple[Lease, float]]] = {}  # key → (lease, parked at)
        self._sweep: asyncio.TimerHandle | None = None

    def granted(self, lease: Lease, keep_alive_s: float | None) -> None:
        """`lease` was just granted for a request that asked `keep_alive_s`."""
        if keep_alive_s != 0:
            self._granted[lease.id] = ((lease.model, keep_alive_s), self._clock())

    def take(self, model: str, keep_alive_s: float | None) -> Lease | None:
        """A kept lease for `model`, if one is here (the one given back last)."""
        parked = self._parked.get((model, keep_alive_s))
        while parked:
            lease, _ = parked.pop()
            held = self._granted.get(lease.id)
            if held is not None and self._clock() - held[1] < self._span_s:
                return replace(lease, load_duration_ns=0) if lease.load_duration_ns else lease
            self._granted.pop(lease.id, None)  # kept past its span: back for real
            self._release(lease.id)
        return None

    def give_back(self, lease: Lease, *, keep: bool = True) -> None:
        """The request holding `lease` ended: keep it for a while, or release it now (always,
        when not `keep`: its holder knows no request follows soon)."""
        held = self._granted.get(lease.id)
        now = self._clock()
        if not keep or held is None or now - held[1] >= self._span_s:
            self._granted.pop(lease.id, None)
            self._release(lease.id)
            return
        self._parked.setdefault(held[0], []).append((lease, now))
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self._linger_s, self._expire)

    def wanted(self, model: str) -> None:
        """Requests wait at the engine for a slot of `model`: give back its kept leases now and
        its leases in use when their requests end."""
        for lease_id, (key, _) in list(self._granted.items()):
            if key[0] == model:
                del self._granted[lease_id]
        for key in [key for key in self._parked if key[0] == model]:
            for lease, _ in self._parked.pop(key):
                self._release(lease.id)

    def flush(self) -> None:
        """Give every kept lease back now."""
        parked, self._parked = self._parked, {}
        for leases in parked.values():
            for lease, _ in leases:
                self._granted.pop(lease.id, None)
                self._release(lease.id)

    def clear(self) -> None:
        """Forget them all (the channel closed: the engine has released them itself)."""
        self._parked.clear()
        self._granted.clear()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    @property
    def kept(self) -> int:
        return sum(len(leases) for leases in self._parked.values())

    def _expire(self) -> None:
        """Give back the leases kept `linger_s` or longer; look again for the others."""
        self._sweep = None
        due = self._clock() - self._linger_s
        for key in list(self._parked):
            leases = self._parked[key]
            keep = [(lease, at) for lease, at in leases if at > due]
            for lease, at in leases:
                if at <= due:
                    self._granted.pop(lease.id, None)
                    self._release(lease.id)
            if keep:
                self._parked[key] = keep
            else:
                del self._parked[key]
        if self._parked:
            self._sweep = asyncio.get_running_loop().call_later(self._linger_s, self._expire)
