"""The lease channel: one long-lived loopback connection per front, carrying leases.

Every request takes a lease and gives it back, so this is the hottest path between the front
and an engine; newline-delimited JSON on a plain TCP stream costs a fraction of an HTTP request
each way. It also makes leases airtight across processes (DESIGN.md §3.3): the leases a
connection holds are released when it closes, so a front that crashes or restarts cannot leave
a model busy forever.

Only the front may use it (DESIGN.md §3.12): the first line of a connection must be a hello that
carries the engine's secret (handed to the engine in $MODELYARD_ENGINE_SECRET, never on its
command line). A connection whose first line is anything else, or that says nothing within
HELLO_TIMEOUT_S, is closed without an answer, so it never gets a lease.

    front → engine  {"op": "hello", "secret": "…", "protocol": 1}
    engine → front  {"op": "hello", "protocol": 1}   (then the lines below, in any order)
    front → engine  {"op": "ping"}   (the front's heartbeat, about four times per
    engine → front  {"op": "pong"}    engine_heartbeat_timeout_s: an engine silent for that long
                                      is down for the front; see front/lease_client.py)
    front → engine  {"op": "acquire", "id": 7, "model": "smollm2", "keep_alive_s": 300}
    engine → front  {"id": 7, "progress": "loading smollm2"}   (only if asked: "progress": true)
    engine → front  {"id": 7, "lease": {...}}   or   {"id": 7, "error": {native error body}}
    front → engine  {"op": "release", "lease": "…"}
    front → engine  {"op": "cancel", "id": 7}   (the front stopped waiting for that grant)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import logging
from typing import Any

import orjson

from modelyard.engine.loop import Engine
from modelyard.errors import ModelyardError
from modelyard.request_ids import REQUEST_ID
from modelyard.wire.lease import HELLO_TIMEOUT_S, MAX_LINE_BYTES, PROTOCOL

log = logging.getLogger("modelyard.engine.leases")



class _Connection:
    def __init__(self, engine: Engine, writer: asyncio.StreamWriter) -> None:
        self.engine = engine
        self.writer = writer
        self.held: set[str] = set()
        self.pending: dict[int, asyncio.Task[None]] = {}

    def _send(self, payload: dict[str, Any]) -> None:
        if not self.writer.is_closing():
            self.writer.write(orjson.dumps(payload) + b"\n")

    async def _grant(
        self, request_id: int, model: str, keep_alive_s: float | None, progress: bool
    ) -> None:
        def say(text: str) -> None:
            self._send({"id": request_id, "progress": text})

        try:
            lease = await self.engine.acquire(
                model, keep_alive_s=keep_alive_s, progress=say if progress else None
            )
        except ModelyardError as exc:
            self._send({"id": request_id, "error": exc.native_body()})
        except Exception as exc:  # never let one request kill the channel
            log.exception("acquire %s failed", model)
            err = ModelyardError(f"engine error: {type(exc).__name__}: {exc}", model=model)
            self._send({"id": request_id, "error": err.native_body()})
        else:
            # No await between the grant and this line: a cancel cannot lose the lease.
            self.held.add(lease.id)
            self._send({"id": request_id, "lease": lease.to_json()})
        finally:
            self.pending.pop(request_id, None)

    def handle(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "acquire":
            request_id = int(message["id"])
            keep_alive = message.get("keep_alive_s")
            context = contextvars.copy_context()  # the grant's logs name the front's request
            context.run(REQUEST_ID.set, message.get("request_id"))
            task = asyncio.create_task(
                self._grant(
                    request_id,
                    str(message["model"]),
                    float(keep_alive) if keep_alive is not None else None,
                    bool(message.get("progress")),
                ),
                context=context,
            )
            self.pending[request_id] = task
        elif op == "ping":
            self._send({"op": "pong"})
        elif op == "release":
            lease_id = str(message["lease"])
            self.held.discard(lease_id)
            self.engine.release(lease_id)
        elif op == "cancel":
            waiting = self.pending.get(int(message["id"]))
            if waiting is not None:
                waiting.cancel()
        else:
            raise ValueError(f"unknown op {op!r}")

    def close(self) -> None:
        for task in self.pending.values():
            task.cancel()
        for lease_id in self.held:
            self.engine.release(lease_id)
        if self.held:
            log.warning("lease channel closed holding %d lease(s); released", len(self.held))
        self.held.clear()
        self.writer.close()


def said_hello(line: bytes, secret: str) -> bool:
    """Whether `line` is a hello carrying `secret`, in this protocol."""
    try:
        hello = orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(hello, dict) or hello.get("op") != "hello":
        return False
    given = hello.get("secret")
    return (hello.get("protocol") == PROTOCOL and isinstance(given, str)
            and hmac.compare_digest(given.encode(), secret.encode()))


async def serve_lease_channel(
    engine: Engine, secret: str, host: str = "127.0.0.1"
) -> asyncio.Server:
    """Listen on a free loopback port (see `server.sockets[0].getsockname()`) for fronts that
    know `secret`."""
    if not secret:
        raise ValueError("the lease channel needs a secret")

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            first = await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT_S)
        except (TimeoutError, ConnectionError, ValueError):
            first = b""
        if not said_hello(first, secret):
            log.warning("lease channel: a connection without the engine's secret was refused")
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            return
        writer.write(orjson.dumps({"op": "hello", "protocol": PROTOCOL}) + b"\n")
        conn = _Connection(engine, writer)
        try:
            while line := await reader.readline():
                try:
                    conn.handle(orjson.loads(line))
                except (ValueError, KeyError, TypeError) as exc:
                    log.error("bad lease-channel message %r: %s", line[:200], exc)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            conn.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    return await asyncio.start_server(on_connect, host, 0, limit=MAX_LINE_BYTES)
