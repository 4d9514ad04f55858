"""What an HTTP client may make a modelyard process hold: head size, header count, and time.

uvicorn's httptools protocol (what it runs when httptools is installed, as uvicorn[standard]
installs it) has no bound on a request head, no bound on its header count and no read timeout:
a 16 MB header was served, four unfinished 100 MB heads grew the front by 400 MB, and
connections sending a byte a second (slowloris) were held forever. This subclass adds, per
connection:

- a head over `max_header_bytes` (request line and header fields) or with more than
  `max_header_count` fields gets 431 and the connection closes; an unfinished head is refused as
  soon as what it sent passes the limit, so the process holds at most the limit plus one read;
- a head not complete `header_read_timeout_s` after the connection opened or its first byte
  arrived gets 408 (or a silent close when nothing came) — idle keep-alive connections keep
  uvicorn's own `timeout_keep_alive`;
- a body that stops coming for `body_read_timeout_s` while the app waits for it gets 408 (or a
  close once the response began); the app sees the client as gone.

Errors are written before any app runs, so they take the API's shape from the path alone (the
front's render.py does the same with the routes it knows).

It also tells a request when its client is gone (`ClientGone`, in the request's scope): the
front's non-streamed answers stop their backend then, and without it each would need a task
listening on `receive()` for the disconnect (a fifth of the front's CPU for a 1-token chat).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from modelyard.errors import HeaderFieldsTooLarge, ModelyardError, RequestTimeout

# What httptools does not hand over per header: ": " and CRLF; the request line's method and
# version are counted the same way (a constant), so the bound is on what the client sent.
_FIELD_OVERHEAD = 4
_REQUEST_LINE_OVERHEAD = 16


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 64 * 1024
    max_header_count: int = 100
    header_read_timeout_s: float = 20.0
    body_read_timeout_s: float = 60.0


CLIENT_GONE = "modelyard.client_gone"  # the scope key of a request's ClientGone


class ClientGone:
    """A request's "the client's connection was lost before its response ended" signal:
    `subscribe(callback)` calls it then, or at once if it happened already. Under a server
    without it (a test's ASGI client) the scope has none: listen on `receive()` instead."""

    __slots__ = ("_callbacks", "happened")

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], None]] = []
        self.happened = False

    def subscribe(self, callback: Callable[[], None]) -> None:
        if self.happened:
            callback()
        else:
            self._callbacks.append(callback)

    def fire(self) -> None:
        if self.happened:
            return
        self.happened = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


class _Refused(Exception):
    """Raised in a parser callback so httptools stops; `send_400_response` answers instead."""


def error_body(path: str, exc: ModelyardError) -> bytes:
    if path.startswith("/v1/"):
        return orjson.dumps(exc.openai_body())
    if path.startswith("/api/"):
        return orjson.dumps(exc.ollama_body())
    return orjson.dumps(exc.native_body())


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    limits: ClassVar[HttpLimits] = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.url = b""
        self._in_head = True  # between messages counts as the next head
        self._head_bytes = 0  # what reads added while the head was unfinished
        self._head_size = 0  # what the parser handed over of the current head
        self._header_count = 0
        self._head_ended_in_read = False
        self._refusal: ModelyardError | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._last_body_at = 0.0

    # Connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        cycle = self.cycle
        gone = None if cycle is None or cycle.response_complete else cycle.scope.get(CLIENT_GONE)
        super().connection_lost(exc)
        if isinstance(gone, ClientGone):
            gone.fire()

    def data_received(self, data: bytes) -> None:
        if self._in_head and self._head_timer is None:
            self._arm_head_timer()
        self._head_ended_in_read = False
        super().data_received(data)
        if self.transport.is_closing() or not self._in_head or self._head_ended_in_read:
            return
        self._head_bytes += len(data)
        if self._head_bytes > self.limits.max_header_bytes:
            self._refuse(self._too_large("the request head"))

    def send_400_response(self, msg: str) -> None:
        """httptools stopped: on our refusal, answer with it; otherwise uvicorn's 400."""
        if self._refusal is None:
            super().send_400_response(msg)
        else:
            self._refuse(self._refusal)

    # Parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[CLIENT_GONE] = ClientGone()  # type: ignore[literal-required]
        self._in_head = True
        self._head_size = _REQUEST_LINE_OVERHEAD
        self._header_count = 0

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._head_size += len(name) + len(value) + _FIELD_OVERHEAD
        if self._header_count > self.limits.max_header_count:
            self._refusal = HeaderFieldsTooLarge(
                f"the request has more than {self.limits.max_header_count} header fields"
            )
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._head_size > self.limits.max_header_bytes:  # a whole head in one read
            self._refusal = self._too_large("the request head")
            raise _Refused
        self._end_head()
        self._last_body_at = self.loop.time()
        self._body_timer = self.loop.call_later(
            self.limits.body_read_timeout_s, self._on_body_timeout
        )
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._last_body_at = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._end_head()
        self._in_head = True  # what follows is the next request's head
        super().on_message_complete()

    # Timers

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(
            self.limits.header_read_timeout_s, self._on_head_timeout
        )

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._in_head:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # a pipelined head waits for the answer before it
            return
        if self._head_bytes == 0 and self._head_size == 0:
            self.transport.close()  # opened and said nothing: no one to answer
            return
        self._refuse(RequestTimeout(
            f"the request head did not arrive within {self.limits.header_read_timeout_s:g} s"
        ))

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.cycle is None or not self.cycle.more_body:
            return
        idle_s = self.loop.time() - self._last_body_at
        if self.flow.read_paused or idle_s < self.limits.body_read_timeout_s:
            # The app is not reading yet (its buffer is full), or the body moved since.
            wait_s = self.limits.body_read_timeout_s - (0.0 if self.flow.read_paused else idle_s)
            self._body_timer = self.loop.call_later(wait_s, self._on_body_timeout)
            return
        cycle = self.cycle
        started = cycle.response_started
        cycle.disconnected = True  # the app's receive() now says the client left
        cycle.message_event.set()
        if started:
            self.transport.close()
        else:
            self._refuse(RequestTimeout(
                f"the request body stopped arriving for {self.limits.body_read_timeout_s:g} s"
            ))

    def _end_head(self) -> None:
        self._in_head = False
        self._head_ended_in_read = True
        self._head_bytes = 0
        self._head_size = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    # Answers

    def _too_large(self, what: str) -> HeaderFieldsTooLarge:
        return HeaderFieldsTooLarge(
            f"{what} is larger than {self.limits.max_header_bytes} bytes"
        )

    def _refuse(self, exc: ModelyardError) -> None:
        """Answer `exc` and close: nothing more is read from this connection."""
        self._cancel_timers()
        body = error_body(self.url.decode("latin-1"), exc)
        content = [STATUS_LINE[exc.status]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend([
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
            b"connection: close\r\n",
            b"\r\n",
            body,
        ])
        self.transport.write(b"".join(content))
        self.transport.close()


def protocol_class(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol for uvicorn's `http=`, with `limits` (uvicorn builds it per connection)."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})
