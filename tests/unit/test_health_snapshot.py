"""The report /health shares (front/ops/snapshot.py): one engines' /status serves every call for
up to max_age_s, concurrent callers share one refresh, and a change the front saw refreshes it at
once. Before it, each /health asked every engine for its full /status."""

from __future__ import annotations

import asyncio

import pytest

from modelyard.front.ops.snapshot import Snapshot

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Engines:
    """Counts the reports asked for; `gate` holds each one until set (a slow engine)."""

    def __init__(self) -> None:
        self.asked = 0
        self.gate = asyncio.Event()
        self.gate.set()

    async def report(self) -> int:
        self.asked += 1
        n = self.asked
        await self.gate.wait()
        return n


async def test_one_report_serves_every_call_within_its_age() -> None:
    engines, clock, key = Engines(), Clock(), ["k"]
    snap = Snapshot(engines.report, lambda: key[0], max_age_s=1.0, clock=clock)
    assert [await snap.get() for _ in range(50)] == [1] * 50
    clock.now += 0.99
    assert await snap.get() == 1
    clock.now += 0.02  # past the age: asked again
    assert await snap.get() == 2
    assert engines.asked == 2


async def test_a_change_the_front_saw_refreshes_at_once() -> None:
    engines, clock, key = Engines(), Clock(), ["before the grant"]
    snap = Snapshot(engines.report, lambda: key[0], max_age_s=60.0, clock=clock)
    assert await snap.get() == 1
    key[0] = "a model granted"
    assert await snap.get() == 2
    assert await snap.get() == 2


async def test_concurrent_callers_share_one_refresh_and_a_leaving_one_does_not_cancel_it() -> None:
    engines, clock = Engines(), Clock()
    snap = Snapshot(engines.report, lambda: "k", clock=clock)
    engines.gate.clear()
    callers = [asyncio.create_task(snap.get()) for _ in range(20)]
    await asyncio.sleep(0)  # every caller is waiting on the one refresh
    callers[0].cancel()
    engines.gate.set()
    results = await asyncio.gather(*callers[1:])
    assert results == [1] * 19
    assert engines.asked == 1


async def test_the_age_counts_from_when_the_report_was_asked_for() -> None:
    engines, clock = Engines(), Clock()
    snap = Snapshot(engines.report, lambda: "k", max_age_s=1.0, clock=clock)
    engines.gate.clear()
    first = asyncio.create_task(snap.get())
    await asyncio.sleep(0)
    clock.now += 1.5  # a slow engine: the answer is already too old when it comes
    engines.gate.set()
    assert await first == 1
    assert await snap.get() == 2


async def test_a_failed_refresh_is_not_kept() -> None:
    clock, calls = Clock(), []

    async def failing() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("engine gone")
        return len(calls)

    snap = Snapshot(failing, lambda: "k", clock=clock)
    with pytest.raises(RuntimeError):
        await snap.get()
    assert await snap.get() == 2
