"""`unless_disconnected` (front/dispatch/dispatcher.py) hands what its work opened to `discard`
however the wait ends, also when the wait itself is cancelled in the step its work finished (a
shutdown, an enclosing wait whose client left): that result is nobody else's (issue 31)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.types import Receive

from modelyard.front.dispatch.dispatcher import unless_disconnected

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def client_still_there() -> Receive:
    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # never disconnects
        return {}

    return receive


async def test_a_wait_cancelled_as_its_work_finished_discards_the_result() -> None:
    discarded: list[str] = []
    waiting: asyncio.Task[str] | None = None

    async def work() -> str:
        assert waiting is not None
        waiting.cancel()  # in the step that finishes the work: before the wait resumes
        return "opened"

    waiting = asyncio.create_task(unless_disconnected(client_still_there(), work(),
                                                      discarded.append))
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert discarded == ["opened"]


async def test_a_wait_cancelled_before_its_work_finished_discards_what_it_opens() -> None:
    discarded: list[str] = []
    started = asyncio.Event()
    finish = asyncio.Event()
    got = asyncio.Event()

    def discard(result: str) -> None:
        discarded.append(result)
        got.set()

    async def work() -> str:
        started.set()
        try:
            await finish.wait()
        except asyncio.CancelledError:
            return "opened anyway"  # as a grant that lands with the cancellation
        return "opened"

    waiting = asyncio.create_task(unless_disconnected(client_still_there(), work(), discard))
    await started.wait()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.wait_for(got.wait(), 5)  # as the work ends, after its cancellation
    assert discarded == ["opened anyway"]
