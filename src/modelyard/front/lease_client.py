"""The front's end of an engine's lease channel (protocol in engine/lease_channel.py)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from typing import Any

import orjson

from modelyard.errors import EngineUnavailable, from_native_body
from modelyard.request_ids import REQUEST_ID
from modelyard.types import Lease

MAX_LINE_BYTES = 1 << 20


class LeaseChannelClosed(Exception):
    pass


class LeaseClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._progress: dict[int, Callable[[str], None]] = {}
        self._closed = False
        self._reading = asyncio.create_task(self._read(), name="lease-channel")

    @classmethod
    async def connect(cls, host: str, port: int) -> LeaseClient:
        reader, writer = await asyncio.open_connection(host, port, limit=MAX_LINE_BYTES)
        return cls(reader, writer)

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
                reply = orjson.loads(line)
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

    def _fail_all(self) -> None:
        self._closed = True
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
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()
