"""The front's end of an engine's lease channel (protocol in engine/lease_channel.py).

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
from typing import Any

import orjson

from modelyard.errors import EngineUnavailable, from_native_body
from modelyard.request_ids import REQUEST_ID
from modelyard.types import Lease
from modelyard.wire.lease import HELLO_TIMEOUT_S, MAX_LINE_BYTES, PROTOCOL

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
        self._name = name
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._progress: dict[int, Callable[[str], None]] = {}
        self._closed = False
        self.silent = False  # no line from the engine for heartbeat_timeout_s
        self.on_silent: Callable[[], None] | None = None
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
        name: str = "engine",
    ) -> LeaseClient:
        """Open the channel and say hello with the engine's secret; LeaseChannelRefused if the
        engine does not answer it."""
        reader, writer = await asyncio.open_connection(host, port, limit=MAX_LINE_BYTES)
        try:
            hello = {"op": "hello", "secret": secret, "protocol": PROTOCOL}
            writer.write(orjson.dumps(hello) + b"\n")
            answer = await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT_S)
            reply = orjson.loads(answer) if answer else None
        except (TimeoutError, ConnectionError, ValueError) as exc:
            writer.close()
            raise LeaseChannelRefused(f"{name}'s lease channel: no hello ({exc!r})") from exc
        if not isinstance(reply, dict) or reply.get("op") != "hello":
            writer.close()
            raise LeaseChannelRefused(f"{name}'s lease channel refused the hello: {answer!r}")
        return cls(reader, writer, heartbeat_timeout_s=heartbeat_timeout_s, name=name)

    @property
    def closed(self) -> bool:
        return self._closed

    def _send(self, payload: dict[str, Any]) -> None:
        if self._closed:
            raise LeaseChannelClosed("lease channel closed")
        self._writer.write(orjson.dumps(payload) + b"\n")

    async def acquire(
        self,
        model: str,
        keep_alive_s: float | None = None,
        on_progress: Callable[[str], None] | None = None,
    ) -> Lease:
        if self.silent:
            raise self._silence()
        request_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        try:
            message: dict[str, Any] = {"op": "acquire", "id": request_id, "model": model}
            if (rid := REQUEST_ID.get()) is not None:
                message["request_id"] = rid  # the engine's logs of this grant carry it
            if keep_alive_s is not None:
                message["keep_alive_s"] = keep_alive_s
            if on_progress is not None:
                message["progress"] = True
                self._progress[request_id] = on_progress
            self._send(message)
            reply = await future
        except asyncio.CancelledError:
            # If the grant is already on its way, _read gives it back.
            if self._waiting.pop(request_id, None) is not None and not self._closed:
                self._send({"op": "cancel", "id": request_id})
            raise
        finally:
            self._progress.pop(request_id, None)
        if "error" in reply:
            raise from_native_body(reply["error"])
        data = reply["lease"]
        return Lease(
            id=data["lease_id"],
            model=data["model"],
            upstream=data["upstream"],
            load_duration_ns=data["load_duration_ns"],
        )

    def release(self, lease_id: str) -> None:
        # A closed channel has released everything on the engine's side already.
        with contextlib.suppress(LeaseChannelClosed):
            self._send({"op": "release", "lease": lease_id})

    async def _read(self) -> None:
        try:
            while line := await self._reader.readline():
                self._heard = self._clock()
                if self.silent:
                    self.silent = False
                    log.warning("%s answers its lease channel again", self._name)
                reply = orjson.loads(line)
                if "op" in reply:  # pong: the heartbeat's answer, nothing more to do
                    continue
                if "progress" in reply:
                    listener = self._progress.get(int(reply["id"]))
                    if listener is not None:
                        listener(str(reply["progress"]))
                    continue
                future = self._waiting.pop(int(reply["id"]), None)
                if future is None or future.done():
                    if "lease" in reply:  # granted to a request that gave up waiting
                        self.release(reply["lease"]["lease_id"])
                    continue
                future.set_result(reply)
        except (ConnectionError, ValueError, asyncio.LimitOverrunError):
            pass
        finally:
            self._fail_all()

    async def _heartbeat(self, timeout_s: float) -> None:
        while not self._closed:
            await asyncio.sleep(timeout_s / PINGS_PER_TIMEOUT)
            with contextlib.suppress(LeaseChannelClosed):
                self._send({"op": "ping"})
            if not self.silent and self._clock() - self._heard > timeout_s:
                self._fall_silent(timeout_s)

    def _silence(self) -> EngineUnavailable:
        return EngineUnavailable(
            f"{self._name} stopped answering (no heartbeat on its lease channel)",
            retry_after_s=2.0,
        )

    def _fall_silent(self, timeout_s: float) -> None:
        self.silent = True
        log.error("%s sent nothing on its lease channel for %.1f s: down until it answers",
                  self._name, timeout_s)
        waiting, self._waiting = self._waiting, {}
        for request_id, future in waiting.items():
            if not future.done():
                future.set_exception(self._silence())
            # A grant that comes later is given back by _read; this lets it not come at all.
            with contextlib.suppress(LeaseChannelClosed):
                self._send({"op": "cancel", "id": request_id})
        if self.on_silent is not None:
            self.on_silent()

    def _fail_all(self) -> None:
        self._closed = True
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
