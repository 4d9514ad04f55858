"""The front's end of an engine's lease channel (the channel: engine/lease_channel.py; its frames:
wire/lease.py). Connecting checks the engine's protocol version: another version is
EngineProtocolMismatch, one clear error instead of frames misread later.

It also keeps the heartbeat: a stopped engine (SIGSTOP, a blocked event loop) closes nothing, so
without one a request would wait for its grant until the supervisor's health probes kill the
engine, tens of seconds later. With `heartbeat_timeout_s`, the client pings about four times per
timeout; an engine that has sent nothing for that long is `silent`: every acquire waiting on it
fails at once with 503 engine_unavailable, new ones are refused, and `on_silent` runs (the engine
client ends that engine's streams). The first line it sends again makes it answer again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable

from modelyard.errors import EngineProtocolMismatch, EngineUnavailable, from_native_body
from modelyard.front.engines.idle_leases import IdleLeases
from modelyard.request_ids import REQUEST_ID
from modelyard.types import Lease
from modelyard.wire.lease import (
    HELLO_TIMEOUT_S,
    MAX_LINE_BYTES,
    PROTOCOL,
    Acquire,
    Cancel,
    CoalescedWriter,
    FrameError,
    Granted,
    Hello,
    HelloReply,
    Ping,
    Progress,
    Refused,
    Release,
    State,
    Ticket,
    Wanted,
    decode_engine_frame,
)
from modelyard.wire.status import EngineStatus

log = logging.getLogger("modelyard.front.leases")

PINGS_PER_TIMEOUT = 4


class LeaseChannelClosed(Exception):
    pass


class LeaseChannelRefused(ConnectionError):
    """The engine closed the channel instead of answering the hello (a wrong secret)."""


class LeaseClient:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        heartbeat_timeout_s: float = 0.0,
        name: str = "engine",
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._out = CoalescedWriter(writer)  # acquires and releases, one write per loop turn
        self._name = name
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Granted | Refused]] = {}
        # Leases given back a moment ago, for the next request for their model (idle_leases.py).
        self._idle = IdleLeases(self.release)
        self._progress: dict[int, Callable[[str], None]] = {}
        self._closed = False
        self.silent = False  # no line from the engine for heartbeat_timeout_s
        self.on_silent: Callable[[], None] | None = None
        self._state: State | None = None  # the engine's latest pushed status, as sent
        self._parsed: tuple[int, EngineStatus] | None = None  # (version, parsed) when read
        self._clock = asyncio.get_running_loop().time
        self._heard = self._clock()
        self._reading = asyncio.create_task(self._read(), name="lease-channel")
        self._beating = (
            asyncio.create_task(self._heartbeat(heartbeat_timeout_s), name="lease-heartbeat")
            if heartbeat_timeout_s > 0 else None
        )

    @classmethod
    async def connect(
        cls, host: str, port: int, secret: str, *, heartbeat_timeout_s: float = 0.0,
        name: str = "engine", state: bool = True,
    ) -> LeaseClient:
        """Open the channel and say hello with the engine's secret (asking for its State
        frames); LeaseChannelRefused if the engine does not answer it, EngineProtocolMismatch
        if it speaks another version."""
        reader, writer = await asyncio.open_connection(host, port, limit=MAX_LINE_BYTES)
        try:
            writer.write(Hello(secret, PROTOCOL, state, wanted=True).encode())
            answer = await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT_S)
            reply = decode_engine_frame(answer) if answer else None
        except (TimeoutError, ConnectionError, ValueError) as exc:
            writer.close()
            raise LeaseChannelRefused(f"{name}'s lease channel: no hello ({exc!r})") from exc
        if not isinstance(reply, HelloReply):
            writer.close()
            raise LeaseChannelRefused(f"{name}'s lease channel refused the hello: {answer!r}")
        if reply.protocol != PROTOCOL:
            writer.close()
            raise EngineProtocolMismatch(
                f"{name} speaks engine protocol {reply.protocol} and this front {PROTOCOL}: "
                "run the same modelyard version on both"
            )
        return cls(reader, writer, heartbeat_timeout_s=heartbeat_timeout_s, name=name)

    @property
    def closed(self) -> bool:
        return self._closed

    def latest_status(self) -> EngineStatus | None:
        """The status the engine pushed last (None: none yet, or an engine that does not
        push); parsed once per version, when routing first reads it."""
        state = self._state
        if state is None or self._closed:
            return None
        if self._parsed is None or self._parsed[0] != state.version:
            self._parsed = (state.version, EngineStatus.from_json(state.status))
        return self._parsed[1]

    def _send(self, frame: Acquire | Release | Cancel | Ping) -> None:
        if self._closed:
            raise LeaseChannelClosed("lease channel closed")
        self._out.write(frame.encode())

    async def acquire(
        self,
        model: str,
        keep_alive_s: float | None = None,
        on_progress: Callable[[str], None] | None = None,
        queue: Ticket | None = None,
    ) -> Lease:
        if self.silent:
            raise self._silence()
        if (kept := self._idle.take(model, keep_alive_s)) is not None:
            return kept
        request_id = next(self._ids)
        future: asyncio.Future[Granted | Refused] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        try:
            if on_progress is not None:
                self._progress[request_id] = on_progress
            # The request id: the engine's logs of this grant carry it.
            self._send(Acquire(request_id, model, keep_alive_s, on_progress is not None,
                               REQUEST_ID.get(), queue))
            reply = await future
        except BaseException:
            self._give_up(request_id, future)
            raise
        finally:
            self._progress.pop(request_id, None)
        if isinstance(reply, Refused):
            raise from_native_body(dict(reply.error))
        if not reply.busy:  # others wait for its slots at the engine: not kept for this front
            self._idle.granted(reply.lease, keep_alive_s)
        return reply.lease

    def _give_up(self, request_id: int, future: asyncio.Future[Granted | Refused]) -> None:
        """The waiter of `request_id` leaves (cancelled: its client gave up) without its lease.

        Still waiting: the engine is told to stop (a grant already on its way is given back by
        _read). Already answered: _read set the grant and the cancellation landed before the
        waiter resumed to take it, so nobody else will release it: given back here."""
        if self._waiting.pop(request_id, None) is not None:
            if not self._closed:
                with contextlib.suppress(LeaseChannelClosed):
                    self._send(Cancel(request_id))
        elif future.done() and not future.cancelled() and future.exception() is None:
            reply = future.result()
            if isinstance(reply, Granted):
                self.release(reply.lease.id)

    def kept_lease(self, model: str, keep_alive_s: float | None) -> Lease | None:
        """A lease this front gave back a moment ago for `model`, if one is kept."""
        return None if self.silent or self._closed else self._idle.take(model, keep_alive_s)

    def give_back(self, lease: Lease, *, keep: bool = True) -> None:
        """The request that held `lease` ended: kept a moment for the next one (idle_leases.py),
        or released (at once when not `keep`)."""
        if not self._closed:
            self._idle.give_back(lease, keep=keep)

    def release(self, lease_id: str) -> None:
        # A closed channel has released everything on the engine's side already.
        with contextlib.suppress(LeaseChannelClosed):
            self._send(Release(lease_id))

    async def _read(self) -> None:
        try:
            while line := await self._reader.readline():
                self._heard = self._clock()
                if self.silent:
                    self.silent = False
                    log.warning("%s answers its lease channel again", self._name)
                reply = decode_engine_frame(line)
                if isinstance(reply, Progress):
                    listener = self._progress.get(reply.id)
                    if listener is not None:
                        listener(reply.text)
                    continue
                if isinstance(reply, State):
                    self._state = reply
                    self._idle.flush()  # its models changed: no lease reused for what went
                    continue
                if isinstance(reply, Wanted):
                    self._idle.wanted(reply.model)  # others wait: none kept ahead of them
                    continue
                if not isinstance(reply, Granted | Refused):
                    continue  # pong: the heartbeat's answer, nothing more to do
                future = self._waiting.pop(reply.id, None)
                if future is None or future.done():
                    if isinstance(reply, Granted):  # granted to a request that gave up waiting
                        self.release(reply.lease.id)
                    continue
                future.set_result(reply)
        except (ConnectionError, FrameError, ValueError, asyncio.LimitOverrunError):
            pass
        finally:
            self._fail_all()

    async def _heartbeat(self, timeout_s: float) -> None:
        while not self._closed:
            await asyncio.sleep(timeout_s / PINGS_PER_TIMEOUT)
            with contextlib.suppress(LeaseChannelClosed):
                self._send(Ping())
            if not self.silent and self._clock() - self._heard > timeout_s:
                self._fall_silent(timeout_s)

    def _silence(self) -> EngineUnavailable:
        return EngineUnavailable(
            f"{self._name} stopped answering (no heartbeat on its lease channel)",
            retry_after_s=2.0,
        )

    def _fall_silent(self, timeout_s: float) -> None:
        self.silent = True
        self._idle.flush()
        log.error("%s sent nothing on its lease channel for %.1f s: down until it answers",
                  self._name, timeout_s)
        waiting, self._waiting = self._waiting, {}
        for request_id, future in waiting.items():
            if not future.done():
                future.set_exception(self._silence())
            # A grant that comes later is given back by _read; this lets it not come at all.
            with contextlib.suppress(LeaseChannelClosed):
                self._send(Cancel(request_id))
        if self.on_silent is not None:
            self.on_silent()

    def _fail_all(self) -> None:
        self._closed = True
        self._idle.clear()
        if self._beating is not None:
            self._beating.cancel()
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(
                    EngineUnavailable("the engine went away", retry_after_s=2.0)
                )
        self._writer.close()

    async def close(self) -> None:
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reading
        if self._beating is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._beating
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()
