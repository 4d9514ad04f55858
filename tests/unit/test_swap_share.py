"""front/dispatch/swap_share.py: the max_swap_share rule as a table of inputs → decisions."""

from __future__ import annotations

import asyncio

import pytest

from modelyard.front.dispatch.swap_share import IDLE_GRACE_S, Charge, SwapLedger, swap_wait_s

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

NOW = 1000.0
# owner a swapped 3 times for 10 s each in a 60 s window (30 s: exactly half), b once
CHARGES = [Charge(950.0, 10.0, "a"), Charge(960.0, 10.0, "a"), Charge(970.0, 10.0, "a"),
           Charge(980.0, 10.0, "b")]
OLD = [Charge(900.0, 50.0, "a")]  # out of the window


@pytest.mark.parametrize(
    ("charges", "owner", "share", "others", "evict", "expected"),
    [
        (CHARGES, "a", 0.5, True, True, None),  # 30 s of 60: at the share, not over it
        (CHARGES, "a", 0.4, True, True, 10.0),  # over 24 s: goes when the 950 swap leaves (1010)
        (CHARGES, "a", 0.2, True, True, 20.0),  # 12 s allowed: two swaps must leave (960 + 60)
        (CHARGES, "a", 0.4, False, True, None),  # nobody else waits for the engine: go
        (CHARGES, "a", 0.4, True, False, None),  # it fits beside the others: go
        (CHARGES, "a", 1.0, True, True, None),  # 1: no limit
        (CHARGES, "b", 0.1, True, True, 40.0),  # b's own 10 s, over 6 s: until 980 + 60
        (CHARGES, "c", 0.1, True, True, None),  # c never swapped
        (OLD, "a", 0.1, True, True, None),  # a's big swap is older than the window
    ],
)
def test_swap_wait_table(
    charges: list[Charge], owner: str, share: float, others: bool, evict: bool,
    expected: float | None,
) -> None:
    got = swap_wait_s(charges, owner, NOW, window_s=60.0, max_share=share,
                      others_demand=others, needs_eviction=evict)
    assert got == (None if expected is None else pytest.approx(expected))


def test_a_load_is_charged_once_to_its_first_owner() -> None:
    ledger = SwapLedger()
    ledger.charge("engine-0", "x", "key-1", "a", 2.0, NOW, 60.0)
    ledger.charge("engine-0", "x", "key-1", "b", 2.0, NOW, 60.0)  # joined the same load
    ledger.charge("engine-0", "x", "key-2", "b", 3.0, NOW + 1, 60.0)  # a new load
    assert list(ledger.charges["engine-0"]) == [Charge(NOW, 2.0, "a"), Charge(NOW + 1, 3.0, "b")]
    assert ledger.charged("engine-0", "a", NOW + 5, 60.0)
    assert not ledger.charged("engine-0", "a", NOW + 61, 60.0)
    assert not ledger.charged("engine-1", "a", NOW, 60.0)
    ledger.charge("engine-0", "y", "key-3", "a", 1.0, NOW + 200, 60.0)
    assert len(ledger.charges["engine-0"]) == 1  # the old ones are dropped


def test_a_reload_after_another_owners_swap_is_charged_to_that_owner() -> None:
    ledger = SwapLedger()
    ledger.charge("engine-0", "x", "k1", "alice", 1.0, NOW, 60.0)  # alice's x evicts bob's z
    ledger.charge("engine-0", "z", "k2", "bob", 1.5, NOW + 2, 60.0, reload=True)
    ledger.charge("engine-0", "w", "k3", "bob", 1.0, NOW + 5, 60.0)  # bob's first load of w
    owners = [c.owner for c in ledger.charges["engine-0"]]
    assert owners == ["alice", "alice", "bob"]
    # a reload long after the last swap is the owner's own
    ledger.charge("engine-0", "z", "k4", "bob", 1.0, NOW + 100, 60.0, reload=True)
    assert ledger.charges["engine-0"][-1].owner == "bob"


def test_an_owner_stays_in_demand_for_a_grace_after_its_request_ended() -> None:
    ledger = SwapLedger()
    ledger.ended("z", "bob", NOW)
    assert ledger.recent("z", NOW + 1.0) == {"bob"}
    assert ledger.recent("z", NOW + IDLE_GRACE_S) == frozenset()
    assert ledger.recent("y", NOW) == frozenset()


async def test_notify_wakes_a_waiter_before_its_timeout() -> None:
    ledger = SwapLedger()
    waiter = asyncio.create_task(ledger.changed(25.0))
    await asyncio.sleep(0)
    assert not waiter.done()
    ledger.notify()
    await asyncio.wait_for(waiter, 5.0)  # well before 25 s
