"""Graceful shutdown of the front: let requests in flight finish, then end them in their API's
own shape rather than cut their connections (DESIGN.md §3.8).

`Drain` knows every HTTP request in flight (the front's edge enters each one). When the
server begins to shut down (it has stopped accepting connections), `begin(grace_s)`:

* ends the feeds at once — open SSE/NDJSON streams that are not answers of a model (the Studio's
  live status, log tails, pull progress): they would never end by themselves;
* lets everything else run for up to `grace_s`: waiting in a queue, loading, streaming;
* then aborts what is left: a relay's upstream read fails with `ServerShuttingDown`, which each
  API's stream renders as its last in-band event (OpenAI SSE error event, Ollama NDJSON
  `{"error"}`, native SSE); a stream still waiting for its model to load says the same in its
  progress framing; a request whose response has not started is answered 503 `shutting_down`
  in its API's error shape.

Request code finds its own record through a context variable: a `Relay` registers itself
(`track_relay`), the streaming paths mark the request as a model's answer (`mark_answer`), and
swap progress waits on `aborted()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from starlette.types import Message, Receive, Scope, Send

from modelyard.errors import ModelyardError, ServerShuttingDown
from modelyard.front.render import error_response

log = logging.getLogger("modelyard.front")

RETRY_AFTER_S = 5.0
_FEED_TYPES = (b"text/event-stream", b"application/x-ndjson")


def shutting_down(grace_s: float) -> ServerShuttingDown:
    return ServerShuttingDown(
        f"the server is shutting down: the request did not finish within shutdown_grace_s "
        f"({grace_s:g} s)",
        retry_after_s=RETRY_AFTER_S,
    )


class Abortable(Protocol):
    def abort(self, exc: ModelyardError) -> None: ...


@dataclass(eq=False)
class InFlight:
    """One HTTP request the front is answering."""

    path: str
    task: asyncio.Task[Any]
    started: bool = False  # its response status went out
    feed_type: bytes | None = None  # SSE/NDJSON content type of a started response
    answer: bool = False  # a model's answer (relay, swap progress), not a feed
    relays: set[Abortable] = field(default_factory=set)
    on_abort: asyncio.Future[ModelyardError] | None = None
    ended_by_drain: bool = False


_CURRENT: ContextVar[InFlight | None] = ContextVar("modelyard_in_flight", default=None)


def in_flight() -> InFlight | None:
    """The current request's record (None outside a request the drain knows)."""
    return _CURRENT.get()


def mark_answer() -> None:
    """The current request streams a model's answer: shutdown gives it the grace."""
    current = _CURRENT.get()
    if current is not None:
        current.answer = True


def track_relay(relay: Abortable) -> Callable[[], None]:
    """Register the current request's relay for abortion; returns the unregister call."""
    current = _CURRENT.get()
    if current is None:
        return _nothing
    current.answer = True
    current.relays.add(relay)
    return lambda: current.relays.discard(relay)


def aborted() -> asyncio.Future[ModelyardError] | None:
    """A future that gets the shutdown error when the grace runs out (None outside a request
    the drain knows)."""
    current = _CURRENT.get()
    if current is None:
        return None
    if current.on_abort is None:
        current.on_abort = asyncio.get_running_loop().create_future()
    return current.on_abort


def _nothing() -> None:
    pass


class Drain:
    """The HTTP requests in flight; `begin(grace_s)` when the server starts shutting down. The
    front's edge (front/api/edge.py) enters each request and watches its response start."""

    def __init__(self) -> None:
        self.in_flight: set[InFlight] = set()
        self.draining = False
        # What a request the drain ends hears: feeds at once, the rest when the grace is over.
        self.error = ServerShuttingDown("the server is shutting down", retry_after_s=RETRY_AFTER_S)

    def enter(self, path: str) -> tuple[InFlight, Token[InFlight | None]]:
        """The current task's request, known until `leave`."""
        task = asyncio.current_task()
        assert task is not None
        record = InFlight(path, task)
        self.in_flight.add(record)
        return record, _CURRENT.set(record)

    def leave(self, record: InFlight, token: Token[InFlight | None]) -> None:
        _CURRENT.reset(token)
        self.in_flight.discard(record)

    @staticmethod
    def started(record: InFlight, message: Message) -> None:
        """`record`'s response started with `message` (its http.response.start)."""
        record.started = True
        for name, value in message.get("headers", ()):
            if name.lower() == b"content-type" and value.startswith(_FEED_TYPES):
                record.feed_type = value

    async def end(self, record: InFlight, scope: Scope, receive: Receive, send: Send) -> None:
        """Finish a response the drain cut short (its task's cancel, taken back), in its API's
        shape."""
        record.task.uncancel()
        exc = self.error
        with contextlib.suppress(OSError, RuntimeError):
            if not record.started:
                await error_response(record.path, exc)(scope, receive, send)
                return
            tail = b""
            if record.feed_type == b"application/x-ndjson":
                body = exc.ollama_body() if record.path.startswith("/api/") else exc.native_body()
                tail = orjson.dumps(body) + b"\n"
            await send({"type": "http.response.body", "body": tail, "more_body": False})

    def begin(self, grace_s: float) -> None:
        """The server stopped accepting: end the feeds now, abort the rest after `grace_s`."""
        if self.draining:
            return
        self.draining = True
        answers = [r for r in self.in_flight if not self._is_feed(r)]
        log.info("shutting down: %d request(s) in flight get up to %g s to finish",
                 len(answers), grace_s)
        for record in self.in_flight:
            if self._is_feed(record):
                self._cancel(record)
        asyncio.get_running_loop().call_later(grace_s, self.abort, grace_s)

    @staticmethod
    def _is_feed(record: InFlight) -> bool:
        return record.started and record.feed_type is not None and not record.answer

    def abort(self, grace_s: float) -> None:
        """The grace is over: every request still in flight ends with `shutting_down`."""
        if not self.in_flight:
            return
        log.warning("shutdown grace (%g s) is over: ending %d request(s) in flight",
                    grace_s, len(self.in_flight))
        exc = self.error = shutting_down(grace_s)
        for record in list(self.in_flight):
            if record.on_abort is not None and not record.on_abort.done():
                record.on_abort.set_result(exc)
            for relay in list(record.relays):
                relay.abort(exc)
            if not record.started:
                self._cancel(record)
        # Streams render their own error event and end; the server's own timeout (the grace
        # plus a margin) cancels whatever cannot.

    @staticmethod
    def _cancel(record: InFlight) -> None:
        record.ended_by_drain = True
        record.task.cancel()
