"""One model's lease slots: at most its `max_concurrency` leases at once, the others wait.

Requests waiting for one of the slots are served first come first served (several fronts each
keep their own queue: the engine is where the model's concurrency holds for all of them). A
release hands a turn to the head of the queue; the turn holds until its waiter takes it, so
`handed` counts the turns handed and not yet taken. The engine's loop owns it (DESIGN.md §3.1):
the number of leases and the limit are the engine's, passed in.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class SlotQueue:
    def __init__(self) -> None:
        self.waiting: deque[asyncio.Future[None]] = deque()
        self.handed = 0  # turns handed to waiters that have not taken them yet

    def free(self, leases: int, limit: int) -> bool:
        return not self.waiting and leases + self.handed < limit

    async def wait(self, hand_on: Callable[[], None]) -> None:
        """Wait in the queue until a release hands this request a turn; `hand_on` hands free
        slots to the next waiters (a turn handed to one that leaves is theirs)."""
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.handed -= 1
                hand_on()  # handed a turn it will not take: the next one's
            elif turn in self.waiting:
                self.waiting.remove(turn)
            raise
        self.handed -= 1

    def hand(self, leases: int, limit: int) -> None:
        """Hand free slots to the waiters at the head of the queue."""
        while self.waiting and leases + self.handed < limit:
            turn = self.waiting.popleft()
            if not turn.done():
                self.handed += 1
                turn.set_result(None)
