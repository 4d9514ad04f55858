"""Lease reuse on the front's side (front/engines/idle_leases.py): what is kept, for how long,
and what goes back to the engine, on a real event loop with a clock the test moves."""

from __future__ import annotations

import asyncio

import pytest

from modelyard.front.engines.idle_leases import IdleLeases
from modelyard.types import Lease

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _lease(n: int, model: str = "m", load_ns: int = 0) -> Lease:
    return Lease(f"l{n}", model, "http://127.0.0.1:1", load_ns)


def _idle(released: list[str], clock: Clock, linger_s: float = 60.0) -> IdleLeases:
    return IdleLeases(released.append, linger_s=linger_s, span_s=0.2, clock=clock)


async def test_a_lease_given_back_is_reused_for_the_same_model_and_keep_alive() -> None:
    released: list[str] = []
    clock = Clock()
    idle = _idle(released, clock)
    idle.granted(_lease(1, load_ns=5_000), keep_alive_s=None)
    idle.give_back(_lease(1, load_ns=5_000))
    assert released == [] and idle.kept == 1
    assert idle.take("other", None) is None
    assert idle.take("m", 30.0) is None  # another keep-alive: its own grant
    again = idle.take("m", None)
    assert again is not None and again.id == "l1"
    assert again.load_duration_ns == 0  # the load was the first grant's, not this request's
    assert idle.take("m", None) is None  # one request at a time per lease
    idle.clear()


async def test_past_its_span_a_lease_goes_back_for_real() -> None:
    released: list[str] = []
    clock = Clock()
    idle = _idle(released, clock)
    idle.granted(_lease(1), keep_alive_s=None)
    clock.now += 0.1
    idle.give_back(_lease(1))  # within the span: kept
    clock.now += 0.15  # now past the span since its grant
    assert idle.take("m", None) is None
    assert released == ["l1"]
    idle.granted(_lease(2), keep_alive_s=None)
    clock.now += 0.3
    idle.give_back(_lease(2))  # given back past its span: released at once
    assert released == ["l1", "l2"] and idle.kept == 0
    idle.clear()


async def test_keep_alive_zero_and_unknown_leases_are_never_kept() -> None:
    released: list[str] = []
    idle = _idle(released, Clock())
    idle.granted(_lease(1), keep_alive_s=0)  # unload at once: the engine must see it idle now
    idle.give_back(_lease(1))
    idle.give_back(_lease(2))  # never granted through here (e.g. an engine that restarted)
    assert released == ["l1", "l2"] and idle.kept == 0


async def test_an_idle_lease_goes_back_after_the_linger() -> None:
    released: list[str] = []
    idle = IdleLeases(released.append, linger_s=0.01, span_s=5.0)  # the real clock
    idle.granted(_lease(1), keep_alive_s=None)
    idle.give_back(_lease(1))
    assert released == []
    for _ in range(200):  # the sweep's timer, on this loop
        if released:
            break
        await asyncio.sleep(0.01)
    assert released == ["l1"] and idle.kept == 0


async def test_flush_gives_every_kept_lease_back_and_clear_forgets_them() -> None:
    released: list[str] = []
    idle = _idle(released, Clock())
    for n in (1, 2, 3):
        idle.granted(_lease(n, model=f"m{n % 2}"), keep_alive_s=None)
        idle.give_back(_lease(n, model=f"m{n % 2}"))
    idle.flush()  # the engine's models changed
    assert sorted(released) == ["l1", "l2", "l3"] and idle.kept == 0
    idle.granted(_lease(4), keep_alive_s=None)
    idle.give_back(_lease(4))
    idle.clear()  # the channel closed: the engine released it itself
    assert "l4" not in released and idle.take("m", None) is None


async def test_a_lease_given_back_not_to_keep_goes_back_at_once() -> None:
    """A tool loop between rounds (front/chat/tools/loop.py) gives its lease back this way: its
    next round comes after its tools run, so the engine must see the lease free meanwhile (a
    kept one counted as held for up to the linger, and another front's request waited on it)."""
    released: list[str] = []
    clock = Clock()
    idle = _idle(released, clock)
    idle.granted(_lease(1), keep_alive_s=None)
    idle.give_back(_lease(1), keep=False)
    assert released == ["l1"] and idle.kept == 0
    assert idle.take("m", None) is None
    idle.granted(_lease(2), keep_alive_s=None)  # the default still keeps
    idle.give_back(_lease(2))
    assert released == ["l1"] and idle.kept == 1
    idle.clear()
