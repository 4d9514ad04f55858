"""Fair share across models: one owner's swaps must not starve another owner's loaded model.

The rule (`max_swap_share`, default 0.5, over `swap_window_s`): on an engine, while another
owner has demand (requests running or queued) for a model loaded there, a request whose model
is cold there and would need an eviction waits if the swap time its owner caused on that engine
in the last window exceeds `max_swap_share` of the window. It goes as soon as the share falls
back (old swaps leave the window), the other owners' demand ends, or, at the latest, fails with
the queue's 503 `queue_timeout` when `queue_timeout_s` runs out.

Why this rule: a swap stops every other model it evicts for its whole load time, so swap *time*
is what one owner takes from the others; counting it per owner and per engine bounds an
alternating owner to a share of the engine's time, and costs nothing while nobody else is using
the engine (no demand: no wait) or when the model is already loaded (no check at all: the gate
runs only for an owner with swaps charged in the window and a cold model).

A swap is charged to the owner of the first request granted from a load (`lease.api_key` names
one load: requests that joined it are not charged again), at its load time (the grant's wait),
except a *reload*: a model that was loaded on that engine before and comes back right after
another owner's swap is charged to that owner — their swap evicted it, so its way back is
theirs too. Without that, the owner whose model was evicted pays as much as the one who
thrashes, and the rule would hold both back alike.

Demand: an owner's requests running or queued for the model, or one that ended in the last
`IDLE_GRACE_S` — a client that sends steadily has a gap between an answer and its next request,
and a waiter woken by that very answer's release must not see the model as unused.

`swap_wait_s` is pure (a table of inputs → decisions); `SwapLedger` keeps the charges and wakes
waiters when demand changes (a slot is released).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

IDLE_GRACE_S = 2.0
_PRUNE_OVER = 64  # owners remembered per model before those past the grace are dropped

@dataclass(frozen=True)
class Charge:
    at: float  # when the load's first grant came (the injected clock)
    seconds: float  # how long the load took
    owner: str


def swap_wait_s(
    charges: Iterable[Charge], owner: str, now: float, *, window_s: float, max_share: float,
    others_demand: bool, needs_eviction: bool,
) -> float | None:
    """None: go now. Else seconds until the owner's swap time in the window falls to the
    allowed share (a waiter re-asks then, or sooner when demand changes)."""
    if not others_demand or not needs_eviction or max_share >= 1.0:
        return None
    mine = sorted((c for c in charges if c.owner == owner and c.at > now - window_s),
                  key=lambda c: c.at)
    allowed = max_share * window_s
    total = sum(c.seconds for c in mine)
    if total <= allowed:
        return None
    for charge in mine:  # the oldest leave the window first
        total -= charge.seconds
        if total <= allowed:
            return max(0.0, charge.at + window_s - now)
    return None  # unreachable: an empty sum is within any share


@dataclass
class SwapLedger:
    """Swap charges per engine (the last window's), and a wake-up for waiters."""

    charges: dict[str, deque[Charge]] = field(default_factory=dict)
    _loads: dict[tuple[str, str], str | None] = field(default_factory=dict)
    _changed: asyncio.Event | None = None
    # model → owner → when its last request of that model ended (the injected clock)
    _ended: dict[str, dict[str, float]] = field(default_factory=dict)

    def ended(self, model: str, owner: str, now: float) -> None:
        """A request of `owner` for `model` ended."""
        found = self._ended.setdefault(model, {})
        found[owner] = now
        if len(found) > _PRUNE_OVER:
            self.recent(model, now)  # drops the owners past the grace

    def recent(self, model: str, now: float) -> frozenset[str]:
        """Owners whose request of `model` ended less than `IDLE_GRACE_S` ago."""
        found = self._ended.get(model)
        if not found:
            return frozenset()
        for owner in [o for o, at in found.items() if at <= now - IDLE_GRACE_S]:
            del found[owner]  # bounded: only owners active in the grace stay
        return frozenset(found)

    def charge(self, engine: str, model: str, load_key: str | None, owner: str,
               seconds: float, now: float, window_s: float, *, reload: bool = False) -> None:
        """A lease that waited for a load of `model` (named by its per-load key) was granted;
        `reload`: the model was loaded on `engine` before."""
        if load_key is not None and self._loads.get((engine, model)) == load_key:
            return  # joined a load already charged
        self._loads[(engine, model)] = load_key
        found = self.charges.setdefault(engine, deque())
        if reload and found and found[-1].at > now - window_s:
            owner = found[-1].owner  # the swap before this one evicted it
        found.append(Charge(now, seconds, owner))
        while found and found[0].at <= now - window_s:
            found.popleft()

    def charged(self, engine: str, owner: str, now: float, window_s: float) -> bool:
        """Cheap first test: whether `owner` has any swap on `engine` in the window."""
        found = self.charges.get(engine)
        # Charges come in time order: when the newest is out of the window, all are (the case
        # of every request to a model that stays loaded, so it is not a scan per request).
        if not found or found[-1].at <= now - window_s:
            return False
        return any(c.owner == owner and c.at > now - window_s for c in found)

    def notify(self) -> None:
        """Demand changed (a slot was released): waiters look again."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def changed(self, timeout_s: float) -> None:
        """Returns on the next `notify()` or after `timeout_s`, whichever comes first."""
        if self._changed is None:
            self._changed = asyncio.Event()
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)
