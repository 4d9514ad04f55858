"""A backend that dies mid-stream: every byte it sent before it died reaches the client, then
the in-band error (front/dispatch/relay.py, front/dispatch/upstream.py).

The backend here is a real socket server that answers with three SSE events and closes the
connection without the last chunk, as a crashed llama-server does. The relay starts reading
only once the connection is known lost: the case of a front busy elsewhere while the last tokens
and the close arrive together, where the lost connection's error is raised ahead of the
bytes still in the body's buffer (test_front_engine's crash-mid-stream test failed that way under
load, with an empty text before the error).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import orjson
import pytest

from modelyard.errors import EngineUnavailable, ModelyardError, UpstreamError
from modelyard.front.dispatch.relay import (
    Relay,
    iter_sse_json,
    new_upstream_session,
    relay_raw,
    send_upstream,
)
from modelyard.front.dispatch.upstream import UpstreamPool
from modelyard.types import Lease

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

WORDS = ["The", " quick", " brown"]
EVENTS = [b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": w}}]}) + b"\n\n"
          for w in WORDS]
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n")


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def crashing_backend() -> tuple[asyncio.Server, str]:
    """Answers every request with HEAD and three events, then closes: no terminating chunk."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        writer.write(HEAD + b"".join(http_chunk(e) for e in EVENTS))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


class Engine:
    """The relay's engine, as far as a relay uses it: watch, release, and whether it is up."""

    name = "engine-0"

    def __init__(self, up: bool = True) -> None:
        self.released: list[Lease] = []
        self.kept: list[bool] = []  # each release's `keep`
        self.up = up

    def watch(self, relay: object) -> Callable[[], None]:
        return lambda: None

    def release(self, lease: Lease, *, keep: bool = True) -> None:
        self.released.append(lease)
        self.kept.append(keep)


async def broken_relay(session: UpstreamPool, url: str, engine: Engine) -> Relay:
    """A relay whose upstream connection is already lost, with the events still unread."""
    response = await send_upstream(session, url + "/v1/chat/completions", b"{}", "crashy")
    relay = Relay(engine, Lease("l1", "crashy", url, 0), response)  # type: ignore[arg-type]

    async def lost() -> None:
        while response.content.exception() is None:  # set when the connection is lost
            await asyncio.sleep(0.005)

    await asyncio.wait_for(lost(), timeout=10)
    return relay


@pytest.fixture
async def backend() -> AsyncIterator[str]:
    server, url = await crashing_backend()
    async with server:
        yield url


async def test_passthrough_relays_every_byte_sent_before_the_crash_then_the_error(
    backend: str,
) -> None:
    engine = Engine()
    async with new_upstream_session(30) as session:
        relay = await broken_relay(session, backend, engine)

        def error_event(exc: ModelyardError) -> bytes:
            return b"ERROR " + exc.code.encode()

        chunks = [chunk async for chunk in relay_raw(relay, error_event)]
    assert b"".join(chunks) == b"".join(EVENTS) + b"ERROR upstream_error"
    assert engine.released == [relay.lease]


async def test_a_translated_stream_reads_every_event_sent_before_the_crash(
    backend: str,
) -> None:
    engine = Engine()
    words: list[str] = []
    async with new_upstream_session(30) as session:
        relay = await broken_relay(session, backend, engine)
        with pytest.raises(UpstreamError, match="broke the stream"):
            async for event in iter_sse_json(relay):
                words.append(event["choices"][0]["delta"]["content"])
        relay.close()
    assert words == WORDS
    assert engine.released == [relay.lease]


async def test_a_stream_broken_because_its_engine_went_away_says_engine_unavailable(
    backend: str,
) -> None:
    """Its node died: the backend's connection reset and the engine is gone (not up) by the
    time the front tells why; the client hears engine_unavailable (retry elsewhere at once),
    not a backend crash."""
    engine = Engine(up=False)
    async with new_upstream_session(30) as session:
        relay = await broken_relay(session, backend, engine)

        def error_event(exc: ModelyardError) -> bytes:
            return b"ERROR " + exc.code.encode()

        chunks = [chunk async for chunk in relay_raw(relay, error_event)]
    assert b"".join(chunks) == b"".join(EVENTS) + b"ERROR engine_unavailable"
    assert engine.released == [relay.lease]


async def test_an_engine_that_goes_down_just_after_its_backend_broke_is_still_the_cause(
    backend: str,
) -> None:
    """The order the processes of a dying node die in: the model server a moment before the
    engine's lease channel closes."""
    engine = Engine(up=True)
    async with new_upstream_session(30) as session:
        relay = await broken_relay(session, backend, engine)
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, setattr, engine, "up", False)
        with pytest.raises(EngineUnavailable, match="went away"):
            async for _ in iter_sse_json(relay):
                pass
        relay.close()


async def test_a_whole_read_not_keeping_its_lease_gives_it_back_so_even_when_it_breaks(
    backend: str,
) -> None:
    """The tool loop reads each round so (front/chat/tools/loop.py): the engine must have the
    lease back while the tools run, whatever the round's end."""
    engine = Engine()
    async with new_upstream_session(30) as session:
        relay = await broken_relay(session, backend, engine)
        with pytest.raises(UpstreamError):
            await relay.read(keep_lease=False)
    assert engine.released == [relay.lease] and engine.kept == [False]
