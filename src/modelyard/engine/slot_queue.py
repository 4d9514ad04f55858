"""One model's lease slots: at most its `max_concurrency` leases at once, the others wait.

A release hands a turn to the best waiter; the turn holds until its waiter takes it, so
`handed` counts the turns handed and not yet taken. The engine's loop owns it (DESIGN.md §3.1):
the number of leases and the limit are the engine's, passed in.

Waiters are served as the front's queue serves them (front/dispatch/queueing.py): higher
priority first, then fair between owners by weight (start-time fair queuing,
placement/fair_tags.py), then first come first served. Only the workers of `serve --workers N`
say whose a request is (the lease's `Ticket`, wire/lease.py): for them this queue is the
model's one queue. A request without a ticket (one front, which queues fairly itself, or several
fronts) waits as owner "" at priority 0, weight 1: among those, first come first served.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from modelyard.placement.fair_tags import FairTags, Tag
from modelyard.wire.lease import Ticket

_PLAIN = Ticket()
_COMPACT_OVER = 64  # left waiters kept in the heap past this many more than the live ones


@dataclass(eq=False, slots=True)
class _Waiter:
    turn: asyncio.Future[None]
    ticket: Ticket
    tag: Tag
    live: bool = True  # in the queue (not handed a turn, not gone)


class SlotQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, _Waiter]] = []
        self._seq = itertools.count()
        self._fair = FairTags()
        self.waiting = 0  # live waiters
        self.handed = 0  # turns handed to waiters that have not taken them yet

    def free(self, leases: int, limit: int) -> bool:
        return not self.waiting and leases + self.handed < limit

    async def wait(self, hand_on: Callable[[], None], ticket: Ticket | None = None) -> None:
        """Wait in the queue until a release hands this request a turn; `hand_on` hands free
        slots to the next waiters (a turn handed to one that leaves is theirs)."""
        ticket = ticket or _PLAIN
        tag = self._fair.arrive(ticket.priority, ticket.owner, ticket.weight)
        waiter = _Waiter(asyncio.get_running_loop().create_future(), ticket, tag)
        heapq.heappush(self._heap, (-ticket.priority, tag.start, next(self._seq), waiter))
        self.waiting += 1
        try:
            await waiter.turn
        except asyncio.CancelledError:
            if waiter.turn.done() and not waiter.turn.cancelled():
                self.handed -= 1
                hand_on()  # handed a turn it will not take: the next one's
            elif waiter.live:
                self._leave(waiter)
            raise
        self.handed -= 1

    def hand(self, leases: int, limit: int) -> None:
        """Hand free slots to the best waiters."""
        while self._heap and leases + self.handed < limit:
            waiter = heapq.heappop(self._heap)[-1]
            if not waiter.live:
                continue
            if waiter.turn.done():  # cancelled, its handler has not run yet: it leaves
                self._leave(waiter)
                continue
            waiter.live = False
            self.waiting -= 1
            self._fair.admitted(waiter.ticket.priority, waiter.tag)
            self.handed += 1
            waiter.turn.set_result(None)

    def _leave(self, waiter: _Waiter) -> None:
        """A waiter gone unserved (cancelled, timed out): not charged to its owner."""
        waiter.live = False
        self.waiting -= 1
        self._fair.withdrawn(waiter.ticket.priority, waiter.ticket.owner, waiter.tag)
        if len(self._heap) > 2 * self.waiting + _COMPACT_OVER:
            self._heap = [entry for entry in self._heap if entry[-1].live]
            heapq.heapify(self._heap)
