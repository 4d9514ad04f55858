"""The relay's streamed answers (front/dispatch/streaming.py): streamed in the request's task,
one task watching the client; a client that leaves ends the stream where it waits, without an
error; a cancel from elsewhere (a shutdown) goes through."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.types import Message

from modelyard.front.dispatch.streaming import WatchedStream

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


class Client:
    """An ASGI client: what it was sent, and a disconnect it sends when told."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.leave = asyncio.Event()

    async def receive(self) -> Message:
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)


async def test_a_stream_is_sent_whole_and_its_watcher_ends() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for word in (b"a", b"b"):
            yield word

    client = Client()
    before = len(asyncio.all_tasks())
    await WatchedStream(chunks(), media_type="text/event-stream")({}, client.receive, client.send)
    assert [m.get("body") for m in client.sent] == [None, b"a", b"b", b""]
    assert client.sent[-1]["more_body"] is False
    await asyncio.sleep(0)  # the watcher's cancel lands
    assert len(asyncio.all_tasks()) == before


async def test_a_client_that_leaves_ends_the_stream_where_it_waits() -> None:
    closed = asyncio.Event()
    waiting = asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        try:
            yield b"first"
            waiting.set()
            await asyncio.Event().wait()  # the backend's next chunk, which never comes
            yield b"never"
        finally:
            closed.set()  # the relay's stream ends (its upstream connection closes)

    client = Client()
    response = WatchedStream(chunks(), media_type="text/event-stream")
    call = asyncio.create_task(response({}, client.receive, client.send))
    await waiting.wait()
    client.leave.set()
    await asyncio.wait_for(call, 5)  # no error: the answer just stops
    assert closed.is_set()
    assert [m.get("body") for m in client.sent] == [None, b"first"]  # incomplete
    assert call.cancelling() == 0


async def test_a_cancel_from_elsewhere_goes_through() -> None:
    waiting = asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"first"
        waiting.set()
        await asyncio.Event().wait()
        yield b"never"

    client = Client()
    call: asyncio.Task[Any] = asyncio.create_task(
        WatchedStream(chunks(), media_type="text/plain")({}, client.receive, client.send))
    await waiting.wait()
    call.cancel()  # a shutdown's grace ended
    with pytest.raises(asyncio.CancelledError):
        await call
