"""The relay's HTTP/1.1 client to backends: a keep-alive pool of asyncio connections whose
responses httptools parses (the parser uvicorn serves the front with).

Why not aiohttp here: a backend call is the front's largest single cost per request, and on
this path nothing of a general client is used (no redirects, cookies, proxies, compression,
multipart). Measured on 2 cores against the fake backend, 1-token chats at c=16: aiohttp's
client spent 249-267 µs of CPU per request, this one 115-126 µs in the same runs (a bare
protocol with none of the keeps below: 68 µs; issue 33's note has the bench-front tables).

What it keeps from the client it replaces (front/dispatch/relay.py relies on each):
- a response's body is read as it arrives (`Body.iter_any`, lines, `read`), chunked or with a
  Content-Length or up to the close; a body not read to its end is never pooled (`close`): its
  connection closes, which is how llama-server learns to stop generating;
- a connection that breaks raises `UpstreamBroken` ahead of the bytes that came before it;
  `Body.take_unread` hands those over (the last tokens a backend sent before it crashed);
- `set_exception` makes the read in progress (or the next) raise (a shutdown, an engine gone);
- a pooled connection the backend closed while idle is retried once on a fresh one (the only
  case where a request is sent twice, and only if no byte of an answer came);
- `read_timeout_s` bounds the wait for each read, from the request's send on; connecting is
  bounded by `connect_timeout_s`;
- a body the relay reads slower than the backend sends pauses the socket's reading past
  `Body.HIGH_WATER` bytes (back-pressure, as aiohttp's reader does).
"""

from __future__ import annotations

import asyncio
import collections
import ssl as ssl_module
import time
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import httptools

KEEPALIVE_S = 4.0  # llama-server closes an idle connection after 5 s: pooled for less
CONNECT_TIMEOUT_S = 10.0


class UpstreamBroken(ConnectionError):
    """The backend's connection broke, timed out or answered something that is not HTTP."""


class ServerDisconnected(UpstreamBroken):
    """The backend closed the connection before its answer was complete."""


class ReadTimeout(UpstreamBroken, TimeoutError):
    """No byte from the backend for `read_timeout_s`."""


class Body:
    """A response's body as it arrives."""

    HIGH_WATER = 1 << 18  # buffered bytes past which the socket stops reading
    LOW_WATER = 1 << 16

    __slots__ = ("_chunks", "_conn", "_eof", "_exc", "_size", "_waiter")

    def __init__(self, conn: _Connection | None) -> None:
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._conn = conn

    # ---- the connection's side ----------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > self.HIGH_WATER and self._conn is not None:
            self._conn.pause()
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        """The read in progress, or the next one, raises `exc` (the buffered bytes wait for
        `take_unread`)."""
        self._exc = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # ---- the reader's side --------------------------------------------------------------------

    def at_eof(self) -> bool:
        return self._eof and not self._chunks

    def exception(self) -> BaseException | None:
        """What the next read raises (a break, a timeout, an abort), if anything."""
        return self._exc

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def readany(self) -> bytes:
        """The next bytes that came (all that are buffered), b"" at the end."""
        while True:
            if self._exc is not None:
                raise self._exc
            if self._chunks:
                if len(self._chunks) == 1:
                    data = self._chunks.popleft()
                else:
                    data = b"".join(self._chunks)
                    self._chunks.clear()
                self._taken(len(data))
                return data
            if self._eof:
                return b""
            await self._wait()

    async def readline(self) -> bytes:
        """The next line, with its b"\\n" (the last one may lack it), b"" at the end."""
        while True:
            if self._exc is not None:
                raise self._exc
            if self._chunks:
                first = self._chunks[0]
                cut = first.find(b"\n")
                if cut >= 0:
                    line = first[:cut + 1]
                    if cut + 1 < len(first):
                        self._chunks[0] = first[cut + 1:]
                    else:
                        self._chunks.popleft()
                    self._taken(len(line))
                    return line
                if len(self._chunks) > 1:  # a line over several chunks: join and look again
                    joined = b"".join(self._chunks)
                    self._chunks.clear()
                    self._chunks.append(joined)
                    if b"\n" in joined:
                        continue
            if self._eof:
                rest = b"".join(self._chunks)
                self._chunks.clear()
                self._taken(len(rest))
                return rest
            await self._wait()

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)

    def take_unread(self) -> bytes:
        """What is buffered, taken out (after a break: the bytes that came before it)."""
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        return data

    async def iter_any(self) -> AsyncIterator[bytes]:
        while data := await self.readany():
            yield data

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._lines()

    async def _lines(self) -> AsyncIterator[bytes]:
        while line := await self.readline():
            yield line

    def _taken(self, n: int) -> None:
        self._size -= n
        if self._size < self.LOW_WATER and self._conn is not None:
            self._conn.resume()


class Headers(dict[str, str]):
    """A response's headers, names lowercased (a repeated one: its values joined by ", ")."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(name.lower(), default)


class UpstreamResponse:
    __slots__ = ("_conn", "content", "headers", "status")

    def __init__(self, conn: _Connection, status: int, headers: Headers) -> None:
        self._conn: _Connection | None = conn
        self.status = status
        self.headers = headers
        self.content = conn.body

    async def read(self) -> bytes:
        return await self.content.read()

    def release(self) -> None:
        """Done with it: its connection goes back to the pool if the body was read to its end
        and both sides keep it alive; else it closes. Once: a pooled connection may carry
        another request's answer by the time a second call came."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.done(pool=self.content.at_eof())

    def close(self) -> None:
        """Done with it, and its connection closes (a body not read to its end)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.done(pool=False)


class _Connection(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool, key: tuple[str, int, bool]) -> None:
        self.pool = pool
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.body = Body(self)
        self.head: asyncio.Future[UpstreamResponse] | None = None
        self.got_bytes = False  # any byte of the current answer came
        self.complete = False  # the current answer came whole
        self.keep_alive = False  # and both sides keep the connection open after it
        self.closed = False
        self.idle_since = 0.0
        self._header_name = b""
        self._headers = Headers()
        self._paused = False
        self._read_timeout_s: float | None = None
        self._heard = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # ---- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self._heard = self.loop.time()
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamBroken("the backend switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBroken(f"the backend's answer is not HTTP ({exc})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        self.pool.forget(self)
        if self.complete:
            return
        if self.head is not None and not self.head.done():
            self.head.set_exception(ServerDisconnected(
                "the backend closed the connection before it answered"))
        elif self.head is not None:
            headers = self._headers
            if ("content-length" not in headers
                    and "chunked" not in (headers.get("transfer-encoding") or "")):
                self.body.feed_eof()  # a body that ends with its connection: it is whole
                return
            self.body.set_exception(ServerDisconnected(
                "the backend closed the connection mid-answer"))

    # ---- httptools callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        found = self._headers.get(key)
        self._headers[key] = text if found is None else f"{found}, {text}"

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 1xx (100 Continue): a final answer follows
            self._headers = Headers()
            return
        head = self.head
        if head is not None and not head.done():
            head.set_result(UpstreamResponse(self, status, self._headers))

    def on_body(self, body: bytes) -> None:
        self.body.feed(body)

    def on_message_complete(self) -> None:
        if self.parser.get_status_code() < 200:
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # read here: the parser resets after
        self._stop_timer()
        self.body.feed_eof()

    # ---- the pool's side ----------------------------------------------------------------------

    def send(self, request: bytes,
             read_timeout_s: float | None) -> asyncio.Future[UpstreamResponse]:
        assert self.transport is not None
        self.head = self.loop.create_future()
        self.got_bytes = self.complete = self.keep_alive = False
        self._headers = Headers()
        self._read_timeout_s = read_timeout_s
        self._heard = self.loop.time()
        if read_timeout_s:
            self._timer = self.loop.call_at(self._heard + read_timeout_s, self._check_timeout)
        self.transport.write(request)
        return self.head

    def done(self, *, pool: bool) -> None:
        """The response is finished with: back to the pool, or closed."""
        self._stop_timer()
        if self.closed:
            return
        if pool and self.complete and self.keep_alive:
            self.resume()
            self.head = None
            self.body = Body(self)
            self.parser = httptools.HttpResponseParser(self)
            self.pool.put(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.abort()

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def _check_timeout(self) -> None:
        self._timer = None
        timeout = self._read_timeout_s
        if timeout is None or self.complete or self.closed:
            return
        due = self._heard + timeout
        if self._paused or self.loop.time() < due:  # heard since (or the reader is slow)
            self._timer = self.loop.call_at(max(due, self.loop.time() + 0.01),
                                            self._check_timeout)
            return
        self._fail(ReadTimeout(f"no answer from the backend for {timeout:g} s"))

    def _fail(self, exc: UpstreamBroken) -> None:
        if self.head is not None and not self.head.done():
            self.head.set_exception(exc)
        else:
            self.body.set_exception(exc)
        self.abort()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


async def _answer(conn: _Connection, request: bytes,
                  read_timeout_s: float | None) -> UpstreamResponse:
    """`request` sent on `conn`, its response's head awaited. A caller that leaves before the
    head came closes the connection: the backend stops, and the connection is never reused
    with an answer of another request still to come on it."""
    try:
        return await conn.send(request, read_timeout_s)
    except BaseException:
        conn.abort()
        raise


class UpstreamPool:
    """Keep-alive connections to the backends, by (host, port, TLS)."""

    def __init__(self, read_timeout_s: float | None = None, *,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        self.read_timeout_s = read_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._targets: dict[str, tuple[tuple[str, int, bool], str]] = {}
        self._ssl: ssl_module.SSLContext | None = None
        self._closed = False

    async def request(self, method: str, url: str, body: bytes,
                      headers: Mapping[str, str]) -> UpstreamResponse:
        """Send the request; its response once its headers came."""
        key, host_header, path = self._target(url)
        head = (f"{method} {path} HTTP/1.1\r\nhost: {host_header}\r\n"
                f"content-length: {len(body)}\r\n"
                + "".join(f"{name}: {value}\r\n" for name, value in headers.items())
                + "\r\n").encode("latin-1")
        request = head + body
        conn = self._take(key)
        if conn is not None:
            try:
                return await _answer(conn, request, self.read_timeout_s)
            except ServerDisconnected:
                if conn.got_bytes:
                    raise
                # closed while it was idle here: the request never reached the backend
        conn = await self._connect(key)
        return await _answer(conn, request, self.read_timeout_s)

    def _target(self, url: str) -> tuple[tuple[str, int, bool], str, str]:
        """(pool key, Host header, path) of `url`; the first two cached per scheme+authority."""
        cut = url.find("/", url.find("//") + 2)
        base, path = (url, "/") if cut < 0 else (url[:cut], url[cut:])
        found = self._targets.get(base)
        if found is None:
            parts = urlsplit(base)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise UpstreamBroken(f"not an http(s) URL: {url!r}")
            tls = parts.scheme == "https"
            port = parts.port or (443 if tls else 80)
            found = self._targets[base] = ((parts.hostname, port, tls), parts.netloc)
        return found[0], found[1], path

    def _take(self, key: tuple[str, int, bool]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.abort()
        return None

    async def _connect(self, key: tuple[str, int, bool]) -> _Connection:
        if self._closed:
            raise UpstreamBroken("the front is shutting down")
        host, port, tls = key
        loop = asyncio.get_running_loop()
        context = None
        if tls:
            if self._ssl is None:
                self._ssl = ssl_module.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, key), host, port, ssl=context,
                    server_hostname=host if tls else None)
        except (OSError, TimeoutError) as exc:
            raise UpstreamBroken(f"cannot connect to {host}:{port} ({exc})") from exc
        self._open.add(conn)
        return conn

    def put(self, conn: _Connection) -> None:
        if self._closed:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)

    def forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    @property
    def idle(self) -> int:
        return sum(len(conns) for conns in self._idle.values())

    async def __aenter__(self) -> UpstreamPool:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection (the front stops)."""
        self._closed = True
        for conn in list(self._open):
            conn.abort()
        self._idle.clear()
        self._open.clear()
