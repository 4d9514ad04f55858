"""The lease channel: one long-lived loopback connection per front, carrying leases.

Every request takes a lease and gives it back, so this is the hottest path between the front
and an engine; newline-delimited JSON on a plain TCP stream costs a fraction of an HTTP request
each way. It also makes leases airtight across processes (DESIGN.md §3.3): the leases a
connection holds are released when it closes, so a front that crashes or restarts cannot leave
a model busy forever.

Only the front may use it (DESIGN.md §3.12): the first line of a connection must be a hello that
carries the engine's secret (handed to the engine in $MODELYARD_ENGINE_SECRET, never on its
command line). A connection whose first line is anything else, or that says nothing within
HELLO_TIMEOUT_S, is closed without an answer, so it never gets a lease. A hello with the secret
is answered with the engine's protocol version; if the front speaks another version, the engine
closes the channel after that answer, and the front reports the mismatch.

The frames (hello, ping/pong, acquire, progress, granted/refused, release, cancel) and their one
encoder and decoder each are in wire/lease.py. The front pings about four times per
engine_heartbeat_timeout_s: an engine silent for that long is down for the front (see
front/engines/lease_client.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import logging
import os

from modelyard.engine.loop import Engine
from modelyard.errors import ModelyardError
from modelyard.log_throttle import Throttled
from modelyard.request_ids import REQUEST_ID
from modelyard.wire.lease import (
    HELLO_TIMEOUT_S,
    MAX_LINE_BYTES,
    PROTOCOL,
    PROTOCOL_OVERRIDE_ENV,
    Acquire,
    Cancel,
    CoalescedWriter,
    FrameError,
    FrontFrame,
    Granted,
    Hello,
    HelloReply,
    Ping,
    Pong,
    Progress,
    Refused,
    Release,
    State,
    Ticket,
    Wanted,
    decode_front_frame,
)

log = logging.getLogger("modelyard.engine.leases")

# State frames while changes keep coming: at most one per this long (a burst of loads, evictions
# and lease waits is one frame), and always one after the last change.
STATE_COALESCE_S = 0.05
# Any local user can send refused hellos as fast as they can connect: one line per this long
# (with the count of the others) says it happens without letting them fill the disk.
REFUSED_LOG_EVERY_S = 10.0


class _Connection:
    def __init__(self, engine: Engine, writer: asyncio.StreamWriter) -> None:
        self.engine = engine
        self.writer = writer
        self.out = CoalescedWriter(writer)  # grants, refusals, progress: one write per loop turn
        self.held: set[str] = set()
        self.pending: dict[int, asyncio.Task[None]] = {}
        self.pushing: asyncio.Task[None] | None = None

    def push_state(self) -> None:
        """Send the engine's status now and after every change of its models (the front asked
        in its hello): routing then reads the front's copy instead of a /status round trip."""
        self.pushing = asyncio.create_task(self._push_states(), name="lease-state")

    async def _push_states(self) -> None:
        version = 0
        while not self.writer.is_closing():
            changed = self.engine.change_event()  # taken before the status: no change missed
            version += 1
            self._send(State(version, self.engine.status().to_json()))
            await changed.wait()
            await asyncio.sleep(STATE_COALESCE_S)  # the changes that follow go in one frame

    def tell_wanted(self) -> None:
        """Send Wanted frames on this channel (the front asked in its hello)."""
        self.engine.slot_wanted.add(self._wanted)

    def _wanted(self, model_id: str) -> None:
        # Only a channel holding leases can keep one; a Wanted per waiting request, coalesced
        # with the turn's other frames.
        if self.held:
            self._send(Wanted(model_id))

    def _send(self, frame: Pong | Progress | Granted | Refused | State | Wanted) -> None:
        if not self.writer.is_closing():
            self.out.write(frame.encode())

    async def _grant(
        self, request_id: int, model: str, keep_alive_s: float | None, progress: bool,
        queue: Ticket | None = None,
    ) -> None:
        def say(text: str) -> None:
            self._send(Progress(request_id, text))

        try:
            lease = await self.engine.acquire(
                model, keep_alive_s=keep_alive_s, progress=say if progress else None,
                ticket=queue,
            )
        except ModelyardError as exc:
            self._send(Refused(request_id, exc.native_body()))
        except Exception as exc:  # never let one request kill the channel
            log.exception("acquire %s failed", model)
            err = ModelyardError(f"engine error: {type(exc).__name__}: {exc}", model=model)
            self._send(Refused(request_id, err.native_body()))
        else:
            # No await between the grant and this line: a cancel cannot lose the lease.
            self.held.add(lease.id)
            self._send(Granted(request_id, lease, self.engine.slots_wanted(lease.model)))
        finally:
            self.pending.pop(request_id, None)

    def handle(self, frame: FrontFrame) -> None:
        if isinstance(frame, Acquire):
            # A ready model is granted here and now: no task, no context copy (the hot path).
            lease = self.engine.lease_ready(frame.model, frame.keep_alive_s)
            if lease is not None:
                self.held.add(lease.id)
                self._send(Granted(frame.id, lease))
                return
            context = contextvars.copy_context()  # the grant's logs name the front's request
            context.run(REQUEST_ID.set, frame.request_id)
            task = asyncio.create_task(
                self._grant(frame.id, frame.model, frame.keep_alive_s, frame.progress,
                            frame.queue),
                context=context,
            )
            self.pending[frame.id] = task
        elif isinstance(frame, Release):
            self.held.discard(frame.lease)
            self.engine.release(frame.lease)
        elif isinstance(frame, Ping):
            self._send(Pong())
        elif isinstance(frame, Cancel):
            waiting = self.pending.get(frame.id)
            if waiting is not None:
                waiting.cancel()
        else:
            raise FrameError(f"unexpected {type(frame).__name__} after the hello")

    def close(self) -> None:
        self.engine.slot_wanted.discard(self._wanted)
        if self.pushing is not None:
            self.pushing.cancel()
        for task in self.pending.values():
            task.cancel()
        for lease_id in self.held:
            self.engine.release(lease_id)
        if self.held:
            log.warning("lease channel closed holding %d lease(s); released", len(self.held))
        self.held.clear()
        self.writer.close()


def said_hello(line: bytes, secret: str) -> Hello | None:
    """The hello `line` is, if it carries `secret` (in whichever protocol version)."""
    try:
        hello = decode_front_frame(line)
    except FrameError:
        return None
    if not isinstance(hello, Hello):
        return None
    return hello if hmac.compare_digest(hello.secret.encode(), secret.encode()) else None


def engine_protocol() -> int:
    """The version this engine speaks: PROTOCOL, unless a test starts one that speaks another."""
    override = os.environ.get(PROTOCOL_OVERRIDE_ENV)
    return int(override) if override else PROTOCOL


async def serve_lease_channel(
    engine: Engine, secret: str, host: str = "127.0.0.1"
) -> asyncio.Server:
    """Listen on a free port of `host` (loopback; the node's address in a cluster: see
    `server.sockets[0].getsockname()`) for fronts that know `secret`."""
    if not secret:
        raise ValueError("the lease channel needs a secret")
    protocol = engine_protocol()
    log_refused = Throttled(log, logging.WARNING, "lease channel: a connection without the "
                            "engine's secret was refused", REFUSED_LOG_EVERY_S)

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            first = await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT_S)
        except (TimeoutError, ConnectionError, ValueError):
            first = b""
        hello = said_hello(first, secret)
        if hello is not None:
            writer.write(HelloReply(protocol).encode())  # the front checks it
            if hello.protocol != protocol:
                log.error("lease channel: the front speaks protocol %s, this engine %s: closed",
                          hello.protocol, protocol)
                hello = None
        else:
            log_refused()
        if hello is None:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            return
        conn = _Connection(engine, writer)
        if hello.state:
            conn.push_state()
        if hello.wanted:
            conn.tell_wanted()
        try:
            while line := await reader.readline():
                try:
                    conn.handle(decode_front_frame(line))
                except (ValueError, KeyError, TypeError) as exc:
                    log.error("bad lease-channel message %r: %s", line[:200], exc)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            conn.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    return await asyncio.start_server(on_connect, host, 0, limit=MAX_LINE_BYTES)
