"""front/dispatch/queueing.py: per-model bounded priority queues, race-free hand-over,
Retry-After."""

from __future__ import annotations

import asyncio
import random

import pytest

from modelyard.front.dispatch.queueing import Limits, ModelQueues, QueueFull, QueueTimeout, Slot

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

M = "m"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def settle(rounds: int = 5) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def waiting(queues: ModelQueues, model: str, n: int) -> None:
    """Let tasks run until `n` waiters are queued (bounded, no real sleeping)."""
    for _ in range(100):
        if queues.queued(model) == n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"expected {n} waiters, have {queues.queued(model)}")


async def test_burst_of_50_never_exceeds_the_concurrency_limit() -> None:
    queues = ModelQueues()
    limits = Limits(max_concurrency=4, max_queue=100)
    rng = random.Random(7)
    held = 0
    most = 0
    done = 0

    async def worker(steps: int) -> None:
        nonlocal held, most, done
        slot = await queues.acquire(M, limits)
        try:
            held += 1
            most = max(most, held)
            assert queues.running(M) <= 4
            for _ in range(steps):
                await asyncio.sleep(0)
        finally:
            held -= 1
            slot.release()
        done += 1

    await asyncio.gather(*(worker(rng.randint(0, 5)) for _ in range(50)))
    assert done == 50
    assert most == 4
    assert (queues.running(M), queues.queued(M)) == (0, 0)
    stats = queues.stats(M)
    assert stats["admitted_total"] == 50
    assert stats["rejected_total"] == 0


async def test_fifo_within_equal_priority() -> None:
    queues = ModelQueues()
    limits = Limits(1, 10)
    holder = await queues.acquire(M, limits)
    order: list[str] = []

    async def run(name: str) -> None:
        with await queues.acquire(M, limits):
            order.append(name)

    tasks = []
    for name in "abcde":
        tasks.append(asyncio.create_task(run(name)))
        await asyncio.sleep(0)  # each enqueues before the next starts
    await waiting(queues, M, 5)
    holder.release()
    await asyncio.gather(*tasks)
    assert order == list("abcde")


async def test_higher_priority_first_then_fifo() -> None:
    queues = ModelQueues()
    limits = Limits(1, 10)
    holder = await queues.acquire(M, limits)
    order: list[str] = []

    async def run(name: str, priority: int) -> None:
        with await queues.acquire(M, limits, priority=priority):
            order.append(name)

    tasks = []
    for name, priority in [("a", 0), ("b", 0), ("c", 5), ("d", 2), ("e", 5), ("f", -1)]:
        tasks.append(asyncio.create_task(run(name, priority)))
        await asyncio.sleep(0)
    await waiting(queues, M, 6)
    holder.release()
    await asyncio.gather(*tasks)
    assert order == ["c", "e", "d", "a", "b", "f"]


async def test_queue_bound_refuses_with_429_and_retry_after() -> None:
    clock = FakeClock()
    queues = ModelQueues(clock=clock)
    limits = Limits(max_concurrency=2, max_queue=3)
    # teach it a service time of 10 s
    first = await queues.acquire(M, limits)
    clock.now += 10
    first.release()
    holders = [await queues.acquire(M, limits) for _ in range(2)]
    waiters = [asyncio.create_task(queues.acquire(M, limits)) for _ in range(3)]
    await waiting(queues, M, 3)

    for _ in range(2):
        with pytest.raises(QueueFull) as info:
            await queues.acquire(M, limits, priority=100)  # priority does not jump the bound
        err = info.value
        assert err.status == 429
        assert err.code == "queue_full"
        assert err.openai_body()["error"]["type"] == "rate_limit_error"
        assert err.model == M
        assert err.retry_after_s is not None and err.retry_after_s >= 1
        # 10 s per request * (3 queued + 1) / 2 slots
        assert err.retry_after_s == pytest.approx(20.0)
        assert err.headers() == {"Retry-After": "20"}
    assert queues.stats(M)["rejected_total"] == 2
    assert queues.queued(M) == 3

    for slot in holders:
        slot.release()
    for task in waiters:
        (await task).release()
    assert (queues.running(M), queues.queued(M)) == (0, 0)


async def test_max_queue_zero_refuses_at_once_with_at_least_one_second() -> None:
    queues = ModelQueues()
    limits = Limits(max_concurrency=1, max_queue=0)
    slot = await queues.acquire(M, limits)
    with pytest.raises(QueueFull) as info:
        await queues.acquire(M, limits)
    assert info.value.retry_after_s == 1.0  # no observation yet: DEFAULT_SERVICE_S, floor 1 s
    slot.release()
    assert queues.stats(M)["rejected_total"] == 1
    (await queues.acquire(M, limits)).release()


async def test_cancelled_waiter_leaves_and_the_next_gets_the_slot() -> None:
    queues = ModelQueues()
    limits = Limits(1, 5)
    holder = await queues.acquire(M, limits)
    order: list[str] = []

    async def run(name: str) -> None:
        with await queues.acquire(M, limits):
            order.append(name)

    tasks = {name: asyncio.create_task(run(name)) for name in "abc"}
    await waiting(queues, M, 3)
    tasks["b"].cancel()  # client disconnect
    await waiting(queues, M, 2)
    holder.release()
    await asyncio.gather(tasks["a"], tasks["c"])
    assert order == ["a", "c"]
    with pytest.raises(asyncio.CancelledError):
        await tasks["b"]
    stats = queues.stats(M)
    assert (stats["running"], stats["queued"], stats["cancelled_total"]) == (0, 0, 1)


async def test_cancel_after_handover_before_resume_passes_the_slot_on() -> None:
    queues = ModelQueues()
    limits = Limits(1, 5)
    holder = await queues.acquire(M, limits)
    order: list[str] = []

    async def run(name: str) -> None:
        with await queues.acquire(M, limits):
            order.append(name)

    a = asyncio.create_task(run("a"))
    b = asyncio.create_task(run("b"))
    await waiting(queues, M, 2)
    holder.release()  # a's future now holds the slot; a has not resumed
    assert queues.running(M) == 1  # reserved for a
    assert queues.queued(M) == 1
    a.cancel()  # the client goes away right after the grant
    # a newcomer arriving before anyone runs cannot steal the reserved slot: it queues
    c = asyncio.create_task(run("c"))
    await asyncio.gather(b, c)
    with pytest.raises(asyncio.CancelledError):
        await a
    assert order == ["b", "c"]
    stats = queues.stats(M)
    assert (stats["running"], stats["queued"]) == (0, 0)
    assert stats["cancelled_total"] == 1
    assert stats["admitted_total"] == 3  # holder, b, c


async def test_cancelled_future_skipped_when_release_comes_before_its_handler() -> None:
    queues = ModelQueues()
    limits = Limits(1, 5)
    holder = await queues.acquire(M, limits)
    order: list[str] = []

    async def run(name: str) -> None:
        with await queues.acquire(M, limits):
            order.append(name)

    a = asyncio.create_task(run("a"))
    b = asyncio.create_task(run("b"))
    await waiting(queues, M, 2)
    a.cancel()  # a's future is cancelled now; its except-handler runs later
    holder.release()  # the hand-over must skip a, not lose the wake-up
    await b
    with pytest.raises(asyncio.CancelledError):
        await a
    assert order == ["b"]
    assert (queues.running(M), queues.queued(M)) == (0, 0)
    assert queues.stats(M)["cancelled_total"] == 1


async def test_release_is_idempotent() -> None:
    queues = ModelQueues()
    limits = Limits(1, 5)
    slot = await queues.acquire(M, limits)
    w1 = asyncio.create_task(queues.acquire(M, limits))
    w2 = asyncio.create_task(queues.acquire(M, limits))
    await waiting(queues, M, 2)
    slot.release()
    slot.release()  # must not admit a second waiter
    assert slot.released
    assert (queues.running(M), queues.queued(M)) == (1, 1)
    s1 = await w1
    assert not w2.done()
    s1.release()
    s2 = await w2
    s2.release()
    s2.release()
    s1.release()
    assert (queues.running(M), queues.queued(M)) == (0, 0)


async def test_timeout_raises_503_and_removes_the_waiter() -> None:
    queues = ModelQueues()
    limits = Limits(1, 5)
    holder = await queues.acquire(M, limits)
    behind = asyncio.create_task(queues.acquire(M, limits))
    await waiting(queues, M, 1)
    with pytest.raises(QueueTimeout) as info:
        await queues.acquire(M, limits, priority=9, timeout_s=0.01)
    err = info.value
    assert err.status == 503
    assert err.code == "queue_timeout"
    assert err.retry_after_s is not None and err.retry_after_s >= 1
    assert "Retry-After" in err.headers()
    assert queues.queued(M) == 1
    assert queues.stats(M)["timed_out_total"] == 1
    holder.release()
    (await behind).release()
    assert (queues.running(M), queues.queued(M)) == (0, 0)


async def test_zero_timeout_when_busy_times_out_at_once_but_free_slot_admits() -> None:
    queues = ModelQueues()
    limits = Limits(1, 5)
    holder = await queues.acquire(M, limits, timeout_s=0)  # free: no waiting, no timeout
    with pytest.raises(QueueTimeout):
        await queues.acquire(M, limits, timeout_s=0)
    assert queues.queued(M) == 0
    holder.release()
    assert queues.stats(M)["timed_out_total"] == 1


async def test_waiter_granted_before_its_timeout_keeps_the_slot() -> None:
    queues = ModelQueues()
    limits = Limits(1, 5)
    holder = await queues.acquire(M, limits)
    waiter = asyncio.create_task(queues.acquire(M, limits, timeout_s=30))
    await waiting(queues, M, 1)
    holder.release()
    slot = await waiter
    assert queues.running(M) == 1
    slot.release()
    assert queues.stats(M)["timed_out_total"] == 0


async def test_limits_increase_admits_waiters_and_decrease_holds_them() -> None:
    queues = ModelQueues()
    small, big = Limits(1, 10), Limits(3, 10)
    first = await queues.acquire(M, small)
    waiters = [asyncio.create_task(queues.acquire(M, small)) for _ in range(3)]
    await waiting(queues, M, 3)
    # a config reload: the next acquire brings larger limits; the older waiters go first
    newcomer = asyncio.create_task(queues.acquire(M, big))
    await settle()
    assert queues.running(M) == 3
    assert queues.queued(M) == 2
    assert [w.done() for w in waiters] == [True, True, False]
    assert not newcomer.done()
    # shrink back: releases do not admit while running >= the new limit
    extra = asyncio.create_task(queues.acquire(M, small))
    await waiting(queues, M, 3)
    first.release()
    (await waiters[0]).release()
    assert queues.running(M) == 1 and queues.queued(M) == 3
    (await waiters[1]).release()  # now below the limit of 1: the next waiter goes in
    slot = await waiters[2]
    assert queues.running(M) == 1
    slot.release()
    (await newcomer).release()
    (await extra).release()
    assert (queues.running(M), queues.queued(M)) == (0, 0)


async def test_stats_fields_with_an_injected_clock() -> None:
    clock = FakeClock()
    queues = ModelQueues(clock=clock)
    limits = Limits(1, 4)
    assert queues.stats() == {}
    assert queues.stats("other")["running"] == 0
    holder = await queues.acquire(M, limits)
    waiter = asyncio.create_task(queues.acquire(M, limits, request_id="r1"))
    await waiting(queues, M, 1)
    clock.now += 3
    stats = queues.stats(M)
    assert stats == {
        "running": 1,
        "queued": 1,
        "max_concurrency": 1,
        "max_queue": 4,
        "admitted_total": 1,
        "rejected_total": 0,
        "timed_out_total": 0,
        "cancelled_total": 0,
        "avg_wait_s": 0.0,
        "avg_service_s": None,
        "longest_wait_s": 3.0,
        "retry_after_s": 2.0,  # default 1 s service * (1 queued + 1) / 1 slot
        "owners": {"": {"running": 1, "queued": 1}},  # anonymous: one owner
    }
    holder.release()  # held 3 s
    slot = await waiter  # waited 3 s
    clock.now += 5
    slot.release()  # held 5 s
    stats = queues.stats()[M]
    assert stats["admitted_total"] == 2
    assert stats["avg_wait_s"] == pytest.approx(0.2 * 3.0)  # EWMA of 0 then 3
    assert stats["avg_service_s"] == pytest.approx(3.0 + 0.2 * (5.0 - 3.0))
    assert stats["longest_wait_s"] == 0.0
    assert stats["running"] == 0 and stats["queued"] == 0
    assert stats["owners"] == {}  # idle owners are forgotten


async def test_position_follows_priority_and_departures() -> None:
    queues = ModelQueues()
    limits = Limits(1, 10)
    holder = await queues.acquire(M, limits)
    a = asyncio.create_task(queues.acquire(M, limits, request_id="a"))
    b = asyncio.create_task(queues.acquire(M, limits, request_id="b"))
    await waiting(queues, M, 2)
    c = asyncio.create_task(queues.acquire(M, limits, priority=1, request_id="c"))
    await waiting(queues, M, 3)
    assert [queues.position(M, r) for r in "abc"] == [1, 2, 0]
    assert queues.position(M, "nope") is None
    assert queues.position("other", "a") is None
    a.cancel()
    await waiting(queues, M, 2)
    assert [queues.position(M, r) for r in "abc"] == [None, 1, 0]
    holder.release()
    slot = await c
    assert queues.position(M, "c") is None
    assert queues.position(M, "b") == 0
    slot.release()
    (await b).release()
    assert (queues.running(M), queues.queued(M)) == (0, 0)


async def test_models_are_independent() -> None:
    queues = ModelQueues()
    limits = Limits(1, 0)
    x = await queues.acquire("x", limits)
    y = await queues.acquire("y", limits)
    with pytest.raises(QueueFull):
        await queues.acquire("x", limits)
    assert queues.running("x") == queues.running("y") == 1
    x.release()
    y.release()
    assert set(queues.stats()) == {"x", "y"}


async def test_many_cancellations_do_not_block_the_queue() -> None:
    queues = ModelQueues()
    limits = Limits(1, 500)
    holder = await queues.acquire(M, limits)
    doomed = [asyncio.create_task(queues.acquire(M, limits)) for _ in range(200)]
    last = asyncio.create_task(queues.acquire(M, limits))
    await waiting(queues, M, 201)
    for task in doomed:
        task.cancel()
    await waiting(queues, M, 1)
    holder.release()
    (await last).release()
    results = await asyncio.gather(*doomed, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    stats = queues.stats(M)
    assert (stats["running"], stats["queued"], stats["cancelled_total"]) == (0, 0, 200)


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError):
        Limits(max_concurrency=0, max_queue=1)
    with pytest.raises(ValueError):
        Limits(max_concurrency=1, max_queue=-1)


async def test_slot_is_a_context_manager() -> None:
    queues = ModelQueues()
    with await queues.acquire(M, Limits(1, 0)) as slot:
        assert isinstance(slot, Slot)
        assert slot.model == M
        assert queues.running(M) == 1
    assert queues.running(M) == 0
