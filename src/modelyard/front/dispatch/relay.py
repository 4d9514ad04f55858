"""The streaming relay between a client and a model's backend (DESIGN.md §3.3, §3.8).

Rules it keeps:
- the lease is released exactly once, after the upstream response is closed, whether the stream
  ends, breaks, or the client goes away before or after the first byte;
- closing the upstream response closes its connection, which is how llama-server learns to stop
  generating when the client disconnects; a non-streamed request is opened and read under a
  ClientWatch, so a client that gives up stops its generation as a stream's does;
- before the first byte an error is a real HTTP status (upstream 4xx/5xx pass through
  unchanged); after it, an in-band error event in the API's own framing, then the stream closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Literal, TypeVar

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from modelyard.errors import (
    ClientClosedRequest,
    EngineUnavailable,
    ModelyardError,
    UpstreamError,
)
from modelyard.front.dispatch.drain import track_relay
from modelyard.front.dispatch.final_usage import FinalUsage
from modelyard.front.dispatch.streaming import WatchedStream
from modelyard.front.dispatch.upstream import Body, UpstreamBroken, UpstreamPool, UpstreamResponse
from modelyard.front.engines.client import EngineClient
from modelyard.front.sse import DONE, read_event
from modelyard.http_limits import ClientGone
from modelyard.metrics import Usage, current, stream_failed, usage_in_body, usage_of
from modelyard.request_ids import outgoing_headers
from modelyard.types import Lease

T = TypeVar("T")
R = TypeVar("R")

# The backends are called with front/dispatch/upstream.py's client (why: its module doc).
RELAY_ERRORS = (UpstreamBroken, TimeoutError)


def new_upstream_session(read_timeout_s: float) -> UpstreamPool:
    return UpstreamPool(read_timeout_s)


async def send_upstream(
    session: UpstreamPool,
    url: str,
    payload: bytes,
    model: str,
    content_type: str = "application/json",
    api_key: str | None = None,
) -> UpstreamResponse:
    """POST the request and read the response headers.

    The headers are built here, never copied from the client's request: its own Authorization
    or x-api-key (its modelyard credentials) never reach a backend; the load's key (the
    lease's `api_key`) does, as `Authorization: Bearer`.

    A pooled connection the backend closed while idle fails before the request reached it, so
    that one case is retried once, on a fresh connection (by the pool).
    """
    headers = {"content-type": content_type, **outgoing_headers()}
    if api_key is not None:
        headers["authorization"] = f"Bearer {api_key}"
    try:
        return await session.request("POST", url, payload, headers)
    except RELAY_ERRORS as exc:
        raise UpstreamError(
            f"backend of '{model}' is unreachable ({type(exc).__name__})", model=model
        ) from exc


def discard_when_done(opening: asyncio.Future[T], discard: Callable[[T], None]) -> None:
    """Cancel `opening` (a relay, or an upstream response, being opened) and hand whatever it
    yields anyway to `discard`, now or when it ends. A cancellation can land after the lease
    was granted (or the response came) and before the waiter resumed to take it: nobody else
    holds it then, and a lease nobody releases keeps its model busy for good (DESIGN.md §3.3)."""

    def close(done: asyncio.Future[T]) -> None:
        if not done.cancelled() and done.exception() is None:
            discard(done.result())

    opening.cancel()
    if opening.done():
        close(opening)
    else:
        opening.add_done_callback(close)


class Relay:
    """One leased request to a backend; `close()` is idempotent and synchronous."""

    def __init__(
        self, engine: EngineClient, lease: Lease, response: UpstreamResponse
    ) -> None:
        self.engine = engine
        self.lease = lease
        self.response = response
        self.on_close: Callable[[], None] | None = None  # e.g. give back the queue slot
        # Runs while the lease is held; a future it returns keeps the lease until it is done.
        self.on_release: Callable[[], asyncio.Future[Any] | None] | None = None
        self.watch: ClientWatch | None = None  # a non-streamed request's client, watched
        # The dispatcher's upstream session, for `call` (set by the dispatcher that opened it).
        self.session: UpstreamPool | None = None
        self._closed = False
        self._body: bytes | None = None  # the body, once read()
        self._untrack = track_relay(self)  # a shutdown past its grace aborts it
        self._unwatch = engine.watch(self)  # so does its engine falling silent
        # The request's record: the relay's events (leased, usage) go to its observers.
        self.record = current.get()
        if self.record is not None:
            self.record.on_leased()

    @property
    def status(self) -> int:
        return self.response.status

    def report_usage(self, usage: Usage | None) -> None:
        """The backend's usage for this answer (the request's `usage` event)."""
        if usage is not None and self.record is not None:
            self.record.on_usage(usage)

    def final_usage(self, *, strip: bool) -> FinalUsage:
        """What reads the usage at the end of this relay's raw stream (`relay_raw`)."""
        return FinalUsage(self.report_usage, strip=strip)

    @property
    def content_type(self) -> str:
        return self.response.headers.get("content-type") or "application/json"

    def header(self, name: str) -> str | None:
        """One of the backend's response headers."""
        return self.response.headers.get(name)

    async def read(self, *, keep_lease: bool = True) -> bytes:
        """The whole body; closes the relay. Under a ClientWatch, a client that disconnects
        before the body is complete ends the wait: the upstream connection is closed (the
        backend stops generating), the lease given back, and ClientClosedRequest raised.
        Read again, it answers the same bytes (an error may be looked at before it is
        rendered: front/chat/ollama_fit.py). `keep_lease`: as in `close`."""
        if self._body is not None:
            return self._body
        try:
            if self.watch is None:
                self._body = await self.response.read()
            else:
                self._body = await self.watch.wait(self.response.read())
            if self.record is not None and self.response.status == 200:
                self.report_usage(usage_in_body(self._body))  # read whole: its usage, once
            return self._body
        except RELAY_ERRORS as exc:
            raise await stream_broke(self, exc) from exc
        finally:
            self.close(keep_lease=keep_lease)

    async def body(self) -> bytes:
        """The whole body, leaving the relay (and its lease) open for `call`."""
        try:
            return await self.response.read()
        except RELAY_ERRORS as exc:
            raise await stream_broke(self, exc) from exc

    async def call(self, path: str, payload: bytes) -> tuple[int, bytes]:
        """Another request to the same backend under this relay's lease, read whole: a feature
        the backend serves in several calls (front/chat/scoring.py) holds one lease, so its model
        is neither evicted nor given to others' requests beyond its concurrency between them."""
        if self.session is None or self._closed:
            raise RuntimeError("Relay.call needs an open relay from the dispatcher")
        response = await send_upstream(self.session, self.lease.upstream + path, payload,
                                       self.lease.model, api_key=self.lease.api_key)
        try:
            return response.status, await response.read()
        except RELAY_ERRORS as exc:
            raise await stream_broke(self, exc) from exc
        finally:
            response.release()

    def iter_chunks(self) -> AsyncIterator[bytes]:
        return self.response.content.iter_any()

    def abort(self, exc: ModelyardError) -> None:
        """Make the upstream read in progress (or the next one) raise `exc`: the stream ends
        with it as its in-band error, a whole-body read with it as its status (a shutdown past
        its grace, an engine that fell silent)."""
        if not self._closed:
            self.response.content.set_exception(exc)

    def close(self, *, keep_lease: bool = True) -> None:
        """Release the lease; a response not read to its end is closed, not pooled.
        `keep_lease=False`: the engine has it back at once, not after the front kept it a moment
        for its next request (front/engines/idle_leases.py).

        Closing the connection is what tells llama-server to stop generating for a client that
        went away.
        """
        if self._closed:
            return
        self._closed = True
        self._untrack()
        if self.watch is not None:
            self.watch.stop()
        self._unwatch()
        if self.response.content.at_eof():
            self.response.release()
        else:
            self.response.close()
        pending = self.on_release() if self.on_release is not None else None
        if pending is not None and not pending.done():
            pending.add_done_callback(lambda _: self.engine.release(self.lease, keep=keep_lease))
        else:
            self.engine.release(self.lease, keep=keep_lease)
        if self.on_close is not None:
            self.on_close()


class ClientWatch:
    """Watches the client of a non-streamed request while its answer is prepared (the queue, a
    load, the backend generating): the body must have been read already. One task listens for
    `http.disconnect` (or, under the front's server, the request's ClientGone signal says so:
    no task); if the client leaves during `wait(work)`, `work` is cancelled there —
    the upstream connection closes, which stops the backend's generation — and
    ClientClosedRequest is raised, counted in the metrics as a stream cut by its client is.
    `stop()` (Relay.close calls it) ends the watch."""

    __slots__ = ("_gone", "_stopped", "_task", "_waiting", "_watcher")

    def __init__(self, receive: Receive, gone: ClientGone | None = None) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._gone = self._waiting = self._stopped = False
        self._watcher: asyncio.Task[None] | None = None
        if gone is not None:  # the request's scope's CLIENT_GONE, under the front's server
            gone.subscribe(self._client_left)
        else:
            self._watcher = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._client_left()

    def _client_left(self) -> None:
        if self._stopped:
            return
        self._gone = True
        if self._waiting:  # else the next wait() sees it: no cancel lands outside a wait
            self._task.cancel()

    def stop(self) -> None:
        self._stopped = True
        if self._watcher is not None:
            self._watcher.cancel()

    async def wait(self, work: Coroutine[Any, Any, T]) -> T:
        if self._gone:
            work.close()
            raise self._left()
        self._waiting = True
        try:
            return await work
        except asyncio.CancelledError:
            if self._gone and self._task.uncancel() == 0:  # ours, not a shutdown's
                raise self._left() from None
            raise
        finally:
            self._waiting = False

    @staticmethod
    def _left() -> ClientClosedRequest:
        return stream_failed(ClientClosedRequest(
            "the client closed the connection before the answer was complete"))


async def watched(watch: ClientWatch | None, opening: Coroutine[Any, Any, R]) -> R:
    """`await opening` (a handler opening its relay) under `watch`, which then goes with the
    relay opened (its `read()` waits under it, its `close()` stops it); without a watch, as is."""
    if watch is None:
        return await opening
    try:
        opened = await watch.wait(opening)
    except BaseException:
        watch.stop()
        raise
    if isinstance(opened, Relay):
        opened.watch = watch
    else:
        watch.stop()
    return opened


class LeasedStream(WatchedStream):
    """A streaming response that closes its Relay however the ASGI call ends."""

    def __init__(self, content: AsyncIterator[bytes], relay: Relay, media_type: str) -> None:
        super().__init__(content, media_type=media_type, headers={"Cache-Control": "no-cache"})
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.relay.close()


def passthrough_error(relay: Relay, body: bytes) -> Response:
    return Response(body, status_code=relay.status, media_type=relay.content_type)


async def relay_raw(
    relay: Relay, on_error: Callable[[ModelyardError], bytes],
    usage: FinalUsage | None = None,
) -> AsyncIterator[bytes]:
    """Upstream bytes unchanged; a broken upstream becomes one in-band error event. With
    `usage`, the stream's end is read for the backend's usage (front/dispatch/final_usage.py)."""
    try:
        if usage is None:
            async for chunk in relay.iter_chunks():
                yield chunk
        else:
            async for chunk in relay.iter_chunks():
                if out := usage.feed(chunk):
                    yield out
            if out := usage.end():
                yield out
    except RELAY_ERRORS as exc:
        left = unread_bytes(relay.response.content)
        if usage is not None:
            left = usage.broken(left)
        if left:
            yield left  # what the backend sent before it broke is the client's too
        yield on_error(stream_failed(await stream_broke(relay, exc)))
    except ModelyardError as exc:  # aborted (shutdown)
        if usage is not None and (left := usage.broken(b"")):
            yield left
        yield on_error(stream_failed(exc))
    finally:
        relay.close()


# A backend whose engine is going (its node died, say) breaks its stream a moment before the
# engine's lease channel closes: how long a broken stream waits to tell the two apart.
ENGINE_GONE_SETTLE_S = 1.0


async def stream_broke(relay: Relay, exc: BaseException) -> ModelyardError:
    """Why `relay`'s upstream broke: its engine went away (engine_unavailable: the node or
    the engine died, and the client may retry at once elsewhere) or only its backend broke the
    stream (upstream_error). Only on the error path: a stream that ends well never waits."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ENGINE_GONE_SETTLE_S
    while relay.engine.up:
        if loop.time() >= deadline:
            return broken_stream(relay.lease, exc)
        await asyncio.sleep(0.05)  # the engine's channel sends no event we could await here
    return EngineUnavailable(
        f"{relay.engine.name} went away while it served '{relay.lease.model}' "
        f"({type(exc).__name__} from its backend); the request may be sent again",
        model=relay.lease.model,
    )


def broken_stream(lease: Lease, exc: BaseException) -> UpstreamError:
    return UpstreamError(
        f"backend of '{lease.model}' broke the stream ({type(exc).__name__}); "
        f"it may have crashed — see GET /admin/logs?model={lease.model}",
        model=lease.model,
    )


async def iter_sse_json(relay: Relay) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of an upstream SSE stream, up to `[DONE]`."""
    try:
        async for raw in relay.response.content:
            event = _sse_event(relay, raw)
            if event == DONE:
                return
            if event is not None:
                if "usage" in event or "timings" in event:  # the backend's final usage
                    relay.report_usage(usage_of(event))
                yield event
    except RELAY_ERRORS as exc:
        # The whole lines the backend sent before it broke are read first.
        for raw in unread_bytes(relay.response.content).splitlines(keepends=True):
            if not raw.endswith(b"\n"):
                break
            event = _sse_event(relay, raw)
            if event == DONE:
                return
            if event is not None:
                yield event
        raise await stream_broke(relay, exc) from exc


def _sse_event(relay: Relay, raw: bytes) -> dict[str, Any] | Literal["done"] | None:
    """One upstream SSE line: its JSON payload, DONE, or None (not a data line); an error
    event or an unreadable one raises UpstreamError."""
    try:
        event = read_event(raw)
    except orjson.JSONDecodeError as exc:
        raise UpstreamError(f"backend sent an unreadable event: {raw[:120]!r}") from exc
    if isinstance(event, dict) and "error" in event:
        err = event["error"]
        message = err.get("message") if isinstance(err, dict) else str(err)
        raise UpstreamError(f"backend error: {message}", model=relay.lease.model)
    return event


def unread_bytes(content: Body) -> bytes:
    """The bytes of a broken upstream connection still in `content`'s buffer, taken out: a
    lost connection's error is raised ahead of the bytes that arrived with it, so the last
    tokens a backend sent before it crashed would vanish whenever the relay was busy as they
    came with the close (tests/integration/test_relay_broken_upstream.py)."""
    return content.take_unread()


async def translated_stream(
    relay: Relay,
    absorb: Callable[[dict[str, Any]], str],
    on_text: Callable[[str], bytes],
    on_done: Callable[[], bytes],
    on_error: Callable[[ModelyardError], bytes],
    on_event: Callable[[], bytes | None] | None = None,
) -> AsyncIterator[bytes]:
    """Upstream SSE turned into another API's framing: a message per text delta, a closing one,
    or one in-band error if the backend fails or the connection breaks mid-stream. `on_event`,
    after each absorbed event, may frame what it carried besides text (reasoning)."""
    try:
        async for event in iter_sse_json(relay):
            text = absorb(event)
            if on_event is not None and (extra := on_event()):
                yield extra
            if text:
                yield on_text(text)
        yield on_done()
    except ModelyardError as exc:
        yield on_error(stream_failed(exc))
    except Exception as exc:  # the connection broke mid-stream
        yield on_error(stream_failed(await stream_broke(relay, exc)))
    finally:
        relay.close()

