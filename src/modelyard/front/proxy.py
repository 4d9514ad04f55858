"""The streaming relay between a client and a model's backend (DESIGN.md §3.3, §3.8).

Rules it keeps:
- the lease is released exactly once, after the upstream response is closed, whether the stream
  ends, breaks, or the client goes away before or after the first byte;
- closing the upstream response closes its connection, which is how llama-server learns to stop
  generating when the client disconnects;
- before the first byte an error is a real HTTP status (upstream 4xx/5xx pass through
  unchanged); after it, an in-band error event in the API's own framing, then the stream closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from modelyard.engine.loop import Lease
from modelyard.errors import ModelyardError, UpstreamError
from modelyard.front.engines import EngineClient

_background: set[asyncio.Task[Any]] = set()


def new_upstream_client(read_timeout_s: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=10.0, read=read_timeout_s, write=30.0, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=128),
    )


class Relay:
    """One leased request to a backend; `close()` is idempotent and never awaits."""

    def __init__(self, engine: EngineClient, lease: Lease) -> None:
        self.engine = engine
        self.lease = lease
        self.response: httpx.Response | None = None
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # A task, not an await: close() runs in `finally` blocks of cancelled scopes.
        task = asyncio.get_running_loop().create_task(self._finish())
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def _finish(self) -> None:
        try:
            if self.response is not None:
                await self.response.aclose()
        finally:
            self.engine.release(self.lease)

    async def open(
        self, client: httpx.AsyncClient, path: str, payload: bytes, *, stream: bool
    ) -> httpx.Response:
        """Send the request upstream; for `stream` only the headers have been read on return."""
        request = client.build_request(
            "POST",
            self.lease.upstream + path,
            content=payload,
            headers={"content-type": "application/json"},
        )
        try:
            self.response = await client.send(request, stream=stream)
        except httpx.TransportError as exc:
            raise UpstreamError(
                f"backend of '{self.lease.model}' is unreachable ({type(exc).__name__})",
                model=self.lease.model,
            ) from exc
        return self.response


class LeasedStream(StreamingResponse):
    """A streaming response that closes its Relay however the ASGI call ends."""

    def __init__(self, content: AsyncIterator[bytes], relay: Relay, media_type: str) -> None:
        super().__init__(content, media_type=media_type, headers={"Cache-Control": "no-cache"})
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.relay.close()


def passthrough_error(response: httpx.Response, body: bytes) -> Response:
    return Response(
        body,
        status_code=response.status_code,
        media_type=response.headers.get("content-type", "application/json"),
    )


async def relay_raw(
    relay: Relay, on_error: Callable[[ModelyardError], bytes]
) -> AsyncIterator[bytes]:
    """Upstream bytes unchanged; a broken upstream becomes one in-band error event."""
    assert relay.response is not None
    try:
        async for chunk in relay.response.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        yield on_error(broken_stream(relay.lease, exc))
    finally:
        relay.close()


def broken_stream(lease: Lease, exc: Exception) -> UpstreamError:
    return UpstreamError(
        f"backend of '{lease.model}' broke the stream ({type(exc).__name__}); "
        "it may have crashed — see `modelyard logs`",
        model=lease.model,
    )


async def iter_sse_json(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of an upstream SSE stream, up to `[DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise UpstreamError(f"backend sent an unreadable event: {data[:120]}") from exc
        if isinstance(event, dict):
            if "error" in event:
                err = event["error"]
                message = err.get("message") if isinstance(err, dict) else str(err)
                raise UpstreamError(f"backend error: {message}")
            yield event


def sse_event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
