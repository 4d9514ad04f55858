"""front/dispatch/fair_share.py and its use by the model queues: weighted fair queuing across
owners within a priority (issue 21 §3)."""

from __future__ import annotations

import asyncio

import pytest

from modelyard.config import FairShareSettings
from modelyard.front.dispatch.fair_share import FairTags, weight_of
from modelyard.front.dispatch.queueing import Limits, ModelQueues, Slot
from modelyard.front.identity.principal import Principal

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

M = "m"


async def waiting(queues: ModelQueues, n: int) -> None:
    for _ in range(200):
        if queues.queued(M) == n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"expected {n} waiters, have {queues.queued(M)}")


async def served_order(
    arrivals: list[tuple[str, float, int]], *, concurrency: int = 1
) -> list[str]:
    """Owners in the order their requests get a slot: one holder takes the slots first, then
    `arrivals` (owner, weight, priority) queue in that order, then slots free one by one."""
    queues = ModelQueues()
    limits = Limits(concurrency, 1000)
    holders = [await queues.acquire(M, limits, owner="holder") for _ in range(concurrency)]
    order: list[str] = []
    tasks: list[asyncio.Task[Slot]] = []
    for owner, weight, priority in arrivals:
        tasks.append(asyncio.create_task(
            queues.acquire(M, limits, owner=owner, weight=weight, priority=priority)))
        await waiting(queues, len(tasks))
    pending = {task: owner for task, (owner, _, _) in zip(tasks, arrivals, strict=True)}
    for holder in holders:
        holder.release()
    while pending:
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in sorted(done, key=lambda t: tasks.index(t)):
            order.append(pending.pop(task))
            task.result().release()
    return order


async def test_one_flooding_owner_does_not_starve_another_at_equal_weights() -> None:
    # a floods 8 requests, then b sends 2: FIFO would serve all of a's first
    order = await served_order([("a", 1.0, 0)] * 8 + [("b", 1.0, 0)] * 2)
    assert order[:4] == ["a", "b", "a", "b"]
    assert order[4:] == ["a"] * 6


async def test_weights_two_to_one_share_the_slots_two_to_one() -> None:
    order = await served_order([("a", 1.0, 0)] * 9 + [("b", 2.0, 0)] * 9)
    first_nine = order[:9]
    assert first_nine.count("b") == 6 and first_nine.count("a") == 3


async def test_a_late_joiner_gets_no_burst_of_credit() -> None:
    queues = ModelQueues()
    limits = Limits(1, 1000)
    holder = await queues.acquire(M, limits, owner="a")
    # a is served alone for a while: 6 requests in turn
    for _ in range(6):
        nxt = asyncio.create_task(queues.acquire(M, limits, owner="a"))
        await waiting(queues, 1)
        holder.release()
        holder = await nxt
    # now both are backlogged: b, a newcomer, alternates with a instead of taking 6 in a row
    tasks = [asyncio.create_task(queues.acquire(M, limits, owner="a")) for _ in range(4)]
    await waiting(queues, 4)
    tasks += [asyncio.create_task(queues.acquire(M, limits, owner="b")) for _ in range(4)]
    await waiting(queues, 8)
    owners = ["a"] * 4 + ["b"] * 4
    order: list[str] = []
    holder.release()
    pending = dict(zip(tasks, owners, strict=True))
    while pending:
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        [task] = done  # one slot: one grant at a time
        order.append(pending.pop(task))
        task.result().release()
    assert order[:4].count("b") == 2, order
    assert order[:6].count("b") == 3, order


async def test_priority_still_goes_first_then_fair_share_within_it() -> None:
    order = await served_order(
        [("a", 1.0, 0)] * 3 + [("b", 1.0, 5)] * 3 + [("a", 1.0, 5)]
    )
    # every priority-5 request before any priority-0 one; within 5, a (one request) is not
    # behind all of b's
    assert order[:4].count("a") == 1 and order[:2].count("a") == 1
    assert order[4:] == ["a"] * 3


async def test_one_owner_alone_stays_fifo() -> None:
    queues = ModelQueues()
    limits = Limits(1, 100)
    holder = await queues.acquire(M, limits, owner="a")
    tasks = [asyncio.create_task(queues.acquire(M, limits, owner="a", request_id=str(i)))
             for i in range(5)]
    await waiting(queues, 5)
    assert [queues.position(M, str(i)) for i in range(5)] == [0, 1, 2, 3, 4]
    holder.release()
    for i, task in enumerate(tasks):
        slot = await task
        assert all(t.done() == (j <= i) for j, t in enumerate(tasks))
        slot.release()


async def test_position_reflects_fair_order() -> None:
    queues = ModelQueues()
    limits = Limits(1, 100)
    holder = await queues.acquire(M, limits, owner="a")
    tasks = [asyncio.create_task(queues.acquire(M, limits, owner="a", request_id=f"a{i}"))
             for i in range(3)]
    await waiting(queues, 3)
    tasks.append(asyncio.create_task(queues.acquire(M, limits, owner="b", request_id="b0")))
    await waiting(queues, 4)
    # a's running request already counts against a: b's first one is next, before a0
    assert queues.position(M, "b0") == 0
    assert queues.position(M, "a0") == 1
    assert queues.stats(M)["owners"] == {"a": {"running": 1, "queued": 3},
                                        "b": {"running": 0, "queued": 1}}
    holder.release()
    pending = set(tasks)
    while pending:  # release in grant order
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result().release()


def test_withdrawn_waiter_gives_its_cost_back() -> None:
    tags = FairTags()
    first = tags.arrive(0, "a", 1.0)
    second = tags.arrive(0, "a", 1.0)
    assert (first.start, second.start) == (0.0, 1.0)
    tags.withdrawn(0, "a", second)
    assert tags.arrive(0, "a", 1.0).start == 1.0  # not 2: the cancelled one is not charged


def test_a_flood_of_waiters_that_left_in_any_order_leaves_no_debt() -> None:
    """test_fair_share_owners' flood ends by cancelling alice's 15 waiters in its tasks' order:
    only a waiter that was her latest gave its cost back, so she kept a debt of about 14
    requests and bob was served alone at the next flood (0.77 of it where 2/3 was due)."""
    tags = FairTags()
    served = tags.arrive(0, "alice", 1.0)
    tags.admitted(0, served)
    queued = [tags.arrive(0, "alice", 1.0) for _ in range(15)]
    for tag in queued:  # earliest first: none is the latest when it leaves, but the last one
        tags.withdrawn(0, "alice", tag)
    assert tags.arrive(0, "alice", 1.0).start == served.finish  # charged for what she got
    assert tags.arrive(0, "bob", 1.0).start == 0.0


def test_a_waiter_that_leaves_while_others_wait_keeps_their_tags() -> None:
    tags = FairTags()
    first, second, third = (tags.arrive(0, "a", 1.0) for _ in range(3))
    tags.withdrawn(0, "a", first)  # the others still wait: their tags stand
    assert tags.arrive(0, "a", 1.0).start == third.finish
    tags.admitted(0, second)
    assert second.owner == "a"


def test_weight_of_user_then_group_then_default() -> None:
    settings = FairShareSettings(weights={"alice": 3.0, "group:ml": 2.0}, default_weight=0.5)
    def who(user: str | None, group: str | None = None) -> Principal:
        return Principal(user, False, frozenset({"inference"}), "token", group=group)

    assert weight_of(settings, who("alice", "ml")) == 3.0
    assert weight_of(settings, who("bob", "ml")) == 2.0
    assert weight_of(settings, who("bob")) == 0.5
    assert weight_of(settings, who(None)) == 0.5
    assert weight_of(settings, None) == 0.5


def test_weights_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        FairShareSettings(weights={"alice": 0.0})
