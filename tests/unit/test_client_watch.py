"""front.proxy.ClientWatch: a non-streamed request's wait ends when its client leaves, and only
then. The client is an ASGI `receive` fed from a queue, as uvicorn feeds it, and, as the front's
server gives it, a ClientGone signal (modelyard/http_limits.py): every test runs both ways."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from modelyard.errors import ClientClosedRequest
from modelyard.front.dispatch.relay import ClientWatch
from modelyard.http_limits import ClientGone

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


class Client:
    """An ASGI receive channel and its ClientGone signal: `leave()` sends `http.disconnect` and
    fires the signal. `watch()`: a ClientWatch on the signal (`signalled`) or on `receive`."""

    signalled = False

    def __init__(self) -> None:
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.gone = ClientGone()

    async def receive(self) -> dict[str, Any]:
        return await self.messages.get()

    def leave(self) -> None:
        self.messages.put_nowait({"type": "http.disconnect"})
        self.gone.fire()

    def watch(self) -> ClientWatch:
        return ClientWatch(self.receive, self.gone if self.signalled else None)


@pytest.fixture(autouse=True, params=["receive", "signal"])
def _both_ways(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Client, "signalled", request.param == "signal")


async def test_a_client_that_leaves_ends_the_wait_and_cancels_the_work() -> None:
    client, started, cancelled = Client(), asyncio.Event(), asyncio.Event()

    async def generating() -> str:
        started.set()
        try:
            await asyncio.Event().wait()  # the backend would generate for a long time
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    async def leave_once_started() -> None:
        await started.wait()
        client.leave()

    leaving = asyncio.create_task(leave_once_started())
    watch = client.watch()  # watches this task
    with pytest.raises(ClientClosedRequest):
        await watch.wait(generating())
    watch.stop()
    await leaving
    assert cancelled.is_set()
    assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]


async def test_an_answer_in_time_is_returned_and_the_watch_stops() -> None:
    client = Client()
    watch = client.watch()

    async def answer() -> str:
        await asyncio.sleep(0)
        return "done"

    assert await watch.wait(answer()) == "done"
    watch.stop()
    await asyncio.sleep(0)
    client.leave()  # after the answer: nothing is cancelled any more
    await asyncio.sleep(0)
    assert asyncio.current_task() is not None
    assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]


async def test_a_client_gone_between_waits_fails_the_next_wait_at_once() -> None:
    client = Client()
    watch = client.watch()
    client.leave()
    for _ in range(3):  # the watcher hears it while nothing waits: it must not cancel the task
        await asyncio.sleep(0)
    assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]

    async def never_run() -> str:
        raise AssertionError("the work of a client that left is not started")

    with pytest.raises(ClientClosedRequest):
        await watch.wait(never_run())
    watch.stop()


async def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    client = Client()

    async def serve() -> None:
        watch = client.watch()
        try:
            await watch.wait(asyncio.Event().wait())
        finally:
            watch.stop()

    task = asyncio.create_task(serve())
    await asyncio.sleep(0)
    task.cancel()  # e.g. the server shutting down: not the client's doing
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_signal_fired_before_the_subscription_is_heard_at_once() -> None:
    gone, heard = ClientGone(), []
    gone.fire()
    gone.subscribe(lambda: heard.append(1))
    gone.fire()  # once only
    assert heard == [1] and gone.happened
