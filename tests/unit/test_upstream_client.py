"""The relay's HTTP/1.1 client (front/dispatch/upstream.py) against real loopback servers that
answer in each of HTTP's ways: keep-alive reuse, chunked / length / until-close bodies, a
pooled connection the server closed while idle, a body left unread, a read timeout, a
connection that breaks mid-body, an abort, a caller that leaves before the answer, and
back-pressure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from modelyard.front.dispatch.upstream import (
    Body,
    ReadTimeout,
    ServerDisconnected,
    UpstreamBroken,
    UpstreamPool,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Backend:
    """A loopback server running `handler` per request, counting connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()  # a connection closed by the client
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.closed.set()
                    return
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.requests.append(head + await reader.readexactly(length))
                await self.handler(reader, writer)
                if writer.is_closing():
                    return
        finally:
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[tuple[Backend, str]]]]:
    backends: list[Backend] = []

    async def start(handler: Handler) -> tuple[Backend, str]:
        backend = Backend(handler)
        backends.append(backend)
        return backend, await backend.start()

    yield start
    for backend in backends:
        assert backend.server is not None
        backend.server.close()


def answer(body: bytes, *extra: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
            % (len(body), b"".join(h + b"\r\n" for h in extra)) + body)


def chunked(*parts: bytes, end: bool = True) -> bytes:
    out = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
           b"transfer-encoding: chunked\r\n\r\n")
    out += b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return out + (b"0\r\n\r\n" if end else b"")


async def stalled(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One event of a stream, then nothing more for longer than a test waits."""
    writer.write(chunked(b"data: 1\n\n", end=False))
    await asyncio.sleep(5)


async def test_one_connection_serves_request_after_request(serve: Callable[..., Awaitable[
        tuple[Backend, str]]]) -> None:  # fmt: skip
    async def handler(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer(b'{"ok":true}', b"X-Speculative: off"))

    backend, url = await serve(handler)
    async with UpstreamPool(10) as pool:
        for _ in range(3):
            r = await pool.request("POST", url + "/v1/chat/completions", b'{"a":1}',
                                   {"content-type": "application/json", "authorization": "B k"})
            assert r.status == 200
            assert r.headers.get("Content-Type") == "application/json"
            assert r.headers.get("x-speculative") == "off"
            assert await r.read() == b'{"ok":true}'
            r.release()
        assert pool.idle == 1
    assert backend.connections == 1
    first = backend.requests[0]
    assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"authorization: B k\r\n" in first and first.endswith(b'\r\n\r\n{"a":1}')


async def test_a_chunked_stream_is_read_as_it_comes_in_lines_and_whole(
        serve: Callable[..., Awaitable[tuple[Backend, str]]]) -> None:  # fmt: skip
    async def handler(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(chunked(b"data: 1\n\nda", b"ta: 2\n\n", b"data: [DONE]\n\n"))

    _, url = await serve(handler)
    async with UpstreamPool(10) as pool:
        r = await pool.request("POST", url + "/s", b"{}", {})
        lines = [line async for line in r.content]
        assert lines == [b"data: 1\n", b"\n", b"data: 2\n", b"\n", b"data: [DONE]\n", b"\n"]
        assert r.content.at_eof()
        r.release()
        again = await pool.request("POST", url + "/s", b"{}", {})
        assert b"".join([c async for c in again.content.iter_any()]).count(b"data:") == 3
        again.release()
        assert pool.idle == 1


async def test_a_body_that_ends_with_its_connection_is_whole(
        serve: Callable[..., Awaitable[tuple[Backend, str]]]) -> None:  # fmt: skip
    async def handler(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    _, url = await serve(handler)
    async with UpstreamPool(10) as pool:
        r = await pool.request("GET", url + "/", b"", {})
        assert await r.read() == b"all of it"
        r.release()
        assert pool.idle == 0  # the server said close: not pooled


async def test_a_pooled_connection_the_server_closed_is_retried_once_on_a_fresh_one(
        serve: Callable[..., Awaitable[tuple[Backend, str]]]) -> None:  # fmt: skip
    served = 0

    async def handler(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        served += 1
        writer.write(answer(b"%d" % served))
        await writer.drain()
        if served == 1:  # keep-alive promised, then closed while idle (llama-server after 5 s)
            await asyncio.sleep(0.05)
            writer.close()

    backend, url = await serve(handler)
    async with UpstreamPool(10) as pool:
        r = await pool.request("POST", url + "/", b"{}", {})
        assert await r.read() == b"1"
        r.release()
        # the close may reach the pool before the next request is sent, or after: either way
        # the request is answered, on a second connection
        await asyncio.sleep(0.01)
        r = await pool.request("POST", url + "/", b"{}", {})
        assert await r.read() == b"2"
        r.release()
    assert backend.connections == 2


async def test_a_body_left_unread_closes_its_connection(
        serve: Callable[..., Awaitable[tuple[Backend, str]]]) -> None:  # fmt: skip
    async def handler(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(chunked(b"data: 1\n\n", end=False))  # a stream still generating

    backend, url = await serve(handler)
    async with UpstreamPool(10) as pool:
        r = await pool.request("POST", url + "/", b"{}", {})
        assert await r.content.readany() == b"data: 1\n\n"
        r.release()  # not at its end: closed, which tells the backend to stop
        await asyncio.wait_for(backend.closed.wait(), 5)
        assert pool.idle == 0


async def test_no_byte_for_the_read_timeout_is_a_read_timeout(
        serve: Callable[..., Awaitable[tuple[Backend, str]]]) -> None:  # fmt: skip
    _, url = await serve(stalled)
    async with UpstreamPool(0.3) as pool:
        r = await pool.request("POST", url + "/", b"{}", {})
        assert await r.content.readany() == b"data: 1\n\n"
        with pytest.raises(ReadTimeout):
            await r.content.readany()
        with pytest.raises(TimeoutError):  # a TimeoutError, as the relay's errors expect
            await r.content.readany()


async def test_a_break_mid_body_is_raised_ahead_of_the_bytes_that_came_before_it(
        serve: Callable[..., Awaitable[tuple[Backend, str]]]) -> None:  # fmt: skip
    async def handler(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(chunked(b"data: 1\n\n", b"data: 2\n\n", end=False))
        await writer.drain()
        writer.close()  # crashed: no last chunk

    _, url = await serve(handler)
    async with UpstreamPool(10) as pool:
        r = await pool.request("POST", url + "/", b"{}", {})
        while r.content.exception() is None:
            await asyncio.sleep(0.005)
        with pytest.raises(ServerDisconnected):
            await r.content.readany()
        assert r.content.take_unread() == b"data: 1\n\ndata: 2\n\n"


async def test_an_abort_makes_the_read_in_progress_raise(
        serve: Callable[..., Awaitable[tuple[Backend, str]]]) -> None:  # fmt: skip
    _, url = await serve(stalled)
    async with UpstreamPool(10) as pool:
        r = await pool.request("POST", url + "/", b"{}", {})
        await r.content.readany()
        reading = asyncio.ensure_future(r.content.readany())
        await asyncio.sleep(0.01)
        r.content.set_exception(RuntimeError("shutting down"))
        with pytest.raises(RuntimeError, match="shutting down"):
            await asyncio.wait_for(reading, 5)
        r.close()


async def test_a_caller_that_leaves_before_the_answer_closes_the_connection(
        serve: Callable[..., Awaitable[tuple[Backend, str]]]) -> None:  # fmt: skip
    async def handler(reader: asyncio.StreamReader, _: asyncio.StreamWriter) -> None:
        await reader.read()  # a load, a long prompt: no head yet, until the client closes

    backend, url = await serve(handler)
    async with UpstreamPool(10) as pool:
        waiting = asyncio.ensure_future(pool.request("POST", url + "/", b"{}", {}))
        while not backend.requests:
            await asyncio.sleep(0.005)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.wait_for(backend.closed.wait(), 5)  # the backend learns it at once
        assert pool.idle == 0


async def test_what_is_not_http_or_not_reachable_is_upstream_broken(
        serve: Callable[..., Awaitable[tuple[Backend, str]]]) -> None:  # fmt: skip
    async def handler(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")

    _, url = await serve(handler)
    async with UpstreamPool(10) as pool:
        with pytest.raises(UpstreamBroken, match="not HTTP"):
            await pool.request("POST", url + "/", b"{}", {})
        with pytest.raises(UpstreamBroken, match="cannot connect"):
            await pool.request("POST", "http://127.0.0.1:9/", b"{}", {})


async def test_a_slow_reader_pauses_the_socket_and_loses_nothing(
        serve: Callable[..., Awaitable[tuple[Backend, str]]]) -> None:  # fmt: skip
    part = b"x" * 65536

    async def handler(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(chunked(*[part] * 32))  # 2 MiB, far past the high-water mark

    _, url = await serve(handler)
    async with UpstreamPool(10) as pool:
        r = await pool.request("POST", url + "/", b"{}", {})
        conn = r._conn
        while not conn._paused and not r.content.at_eof():
            await asyncio.sleep(0.005)
        assert conn._paused  # the socket stopped reading while nobody read the body
        assert r.content._size <= Body.HIGH_WATER + (1 << 18)  # one socket read past it at most
        body = await r.read()
        assert body == part * 32
        r.release()
        assert pool.idle == 1


async def test_a_second_release_leaves_the_connection_to_its_next_answer(
        serve: Callable[..., Awaitable[tuple[Backend, str]]]) -> None:  # fmt: skip
    async def handler(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer(b"ok"))

    backend, url = await serve(handler)
    async with UpstreamPool(10) as pool:
        first = await pool.request("POST", url + "/", b"{}", {})
        assert await first.read() == b"ok"
        first.release()
        second = await pool.request("POST", url + "/", b"{}", {})  # on the same connection
        first.release()  # again (a bug elsewhere): must not touch the connection now in use
        first.close()
        assert await second.read() == b"ok"
        second.release()
        third = await pool.request("POST", url + "/", b"{}", {})  # still that connection
        assert await third.read() == b"ok"
        third.release()
        assert pool.idle == 1
    assert backend.connections == 1
