"""The engine's slot queue orders its waiters as the front's queue does (engine/slot_queue.py):
priority first, then fair between owners by weight, then first come first served; a waiter
that leaves is not charged. And the lease channel carries how a request waits (its `Ticket`)
only when it is given: an Acquire without one is the frame it always was."""

from __future__ import annotations

import asyncio

import pytest

from modelyard.engine.slot_queue import SlotQueue
from modelyard.wire import lease as wire

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class Model:
    """One slot (`limit` 1) held by a lease until `release`; the queue hands it on."""

    def __init__(self, limit: int = 1) -> None:
        self.queue = SlotQueue()
        self.limit = limit
        self.leases = limit  # all taken: every request waits
        self.served: list[str] = []

    def hand(self) -> None:
        self.queue.hand(self.leases, self.limit)

    async def request(self, name: str, ticket: wire.Ticket | None) -> None:
        await self.queue.wait(self.hand, ticket)
        self.leases += 1  # granted with no await between (engine/loop.py `_lease`)
        self.served.append(name)

    async def serve(self, count: int) -> None:
        """Release `count` leases one after the other, letting each grant land."""
        for _ in range(count):
            self.leases -= 1
            self.hand()
            for _ in range(3):
                await asyncio.sleep(0)


async def _queued(model: Model, *requests: tuple[str, wire.Ticket | None]
                  ) -> list[asyncio.Task[None]]:
    tasks = []
    for name, ticket in requests:
        tasks.append(asyncio.create_task(model.request(name, ticket)))
        await asyncio.sleep(0)  # queued in this order
    return tasks


def test_a_flooding_owner_does_not_starve_another() -> None:
    async def run() -> list[str]:
        model = Model()
        flood = [(f"a{i}", wire.Ticket("alice")) for i in range(6)]
        tasks = await _queued(model, *flood, ("b0", wire.Ticket("bob")),
                              ("b1", wire.Ticket("bob")))
        await model.serve(8)
        await asyncio.gather(*tasks)
        return model.served

    served = asyncio.run(run())
    # FIFO would serve bob 7th and 8th; fair share alternates once bob waits.
    assert served[:4] == ["a0", "b0", "a1", "b1"], served


def test_weights_and_priority_order_the_waiters() -> None:
    async def run() -> list[str]:
        model = Model()
        tasks = await _queued(
            model,
            *[(f"a{i}", wire.Ticket("alice", weight=1.0)) for i in range(4)],
            *[(f"b{i}", wire.Ticket("bob", weight=3.0)) for i in range(4)],
            ("urgent", wire.Ticket("carol", priority=5)),
        )
        await model.serve(9)
        await asyncio.gather(*tasks)
        return model.served

    served = asyncio.run(run())
    assert served[0] == "urgent"  # strict priority, whoever came first
    # bob weighs 3: his tags advance by 1/3, alice's by 1 (equal tags: first come first)
    assert served[1:] == ["a0", "b0", "b1", "b2", "a1", "b3", "a2", "a3"], served


def test_without_tickets_the_queue_is_first_come_first_served() -> None:
    async def run() -> list[str]:
        model = Model()
        tasks = await _queued(model, *[(f"r{i}", None) for i in range(5)])
        await model.serve(5)
        await asyncio.gather(*tasks)
        return model.served

    assert asyncio.run(run()) == [f"r{i}" for i in range(5)]


def test_a_waiter_that_leaves_is_not_charged_and_its_turn_goes_on() -> None:
    async def run() -> tuple[list[str], int]:
        model = Model()
        tasks = await _queued(model, ("a0", wire.Ticket("alice")), ("a1", wire.Ticket("alice")),
                              ("b0", wire.Ticket("bob")))
        tasks[1].cancel()  # alice's second gives up: it does not count against her
        with pytest.raises(asyncio.CancelledError):
            await tasks[1]
        late = await _queued(model, ("a2", wire.Ticket("alice")))
        await model.serve(3)
        await asyncio.gather(tasks[0], tasks[2], *late)
        return model.served, model.queue.waiting

    served, waiting = asyncio.run(run())
    assert served == ["a0", "b0", "a2"] and waiting == 0


def test_a_ticket_travels_in_the_acquire_frame_only_when_given() -> None:
    plain = wire.Acquire(7, "m")
    assert plain.encode() == b'{"op":"acquire","id":7,"model":"m"}\n'
    assert wire.decode_front_frame(plain.encode()) == plain
    ticketed = wire.Acquire(8, "m", queue=wire.Ticket("ann", 2.0, 3, 12.5))
    assert wire.decode_front_frame(ticketed.encode()) == ticketed
    with pytest.raises(wire.FrameError):
        wire.decode_front_frame(b'{"op":"acquire","id":9,"model":"m","queue":{"weight":0}}\n')
    with pytest.raises(wire.FrameError):
        wire.decode_front_frame(b'{"op":"acquire","id":9,"model":"m","queue":[1]}\n')
