"""Swap progress (opt-in, `notify_model_swap`): a streaming request that has to wait for a model
to load hears what happens meanwhile — unloading X, loading Y, ready — as reasoning deltas
before its first token, as the llama.cpp router does.

A request for a model that is ready gets no progress and is answered as usual (real HTTP
statuses). Only once the first progress line arrives does the response start; from then on an
error is an in-band event, as after any first byte (DESIGN.md §3.8).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from modelyard.errors import ModelyardError, UpstreamError
from modelyard.front.dispatch import drain
from modelyard.front.dispatch.relay import Relay, discard_when_done
from modelyard.front.dispatch.streaming import WatchedStream
from modelyard.front.state import upstream_message
from modelyard.metrics import counting_errors


@dataclass
class Pending:
    """A relay still being opened, with the progress lines heard so far."""

    relay: asyncio.Task[Relay]
    first: str
    lines: asyncio.Queue[str]

    def close(self) -> None:
        """Stop opening the relay, and close it if it opened (now or when it does): its
        stream ended, or never started (the client left first)."""
        discard_when_done(self.relay, Relay.close)


async def relay_or_progress(
    open_relay: Callable[[Callable[[str], None]], Awaitable[Relay]],
) -> Relay | Pending:
    """The relay if it opens without a word of progress (a ready model), else Pending."""
    lines: asyncio.Queue[str] = asyncio.Queue()
    task = asyncio.ensure_future(open_relay(lines.put_nowait))
    heard = asyncio.ensure_future(lines.get())
    try:
        await asyncio.wait({task, heard}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        discard_when_done(task, Relay.close)  # it may have opened already: nobody else takes it
        raise
    finally:
        heard.cancel()
    if task.done():
        return task.result()
    return Pending(task, heard.result(), lines)


async def progress_then_relay(
    pending: Pending,
    render_progress: Callable[[str], bytes],
    render_error: Callable[[ModelyardError], bytes],
    body: Callable[[Relay], AsyncIterator[bytes]],
    upstream_message: Callable[[bytes], str],
) -> AsyncIterator[bytes]:
    """Progress events until the relay opens, then the relay's own body (which closes it)."""
    task, lines = pending.relay, pending.lines
    relay: Relay | None = None
    render_error = counting_errors(render_error)  # /metrics: the request ends in-band
    shutdown = drain.aborted()  # the server's shutdown grace ran out while it waited
    try:
        yield render_progress(pending.first)
        while not task.done() or not lines.empty():
            if not lines.empty():
                yield render_progress(lines.get_nowait())
                continue
            heard = asyncio.ensure_future(lines.get())
            waits: set[asyncio.Future[Any]] = {task, heard}
            if shutdown is not None:
                waits.add(shutdown)
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if heard.done():
                yield render_progress(heard.result())
            else:
                heard.cancel()
            if shutdown is not None and shutdown.done() and not task.done():
                yield render_error(shutdown.result())
                return
        try:
            relay = task.result()
        except ModelyardError as exc:
            yield render_error(exc)
            return
        if relay.status != 200:
            text = upstream_message(await relay.read())
            yield render_error(UpstreamError(text, model=relay.lease.model))
            return
        async for chunk in body(relay):
            yield chunk
    finally:
        pending.close()  # the relay, if it opened (used or not: the client may have left)



async def open_for_stream(
    open_relay: Callable[[Callable[[str], None] | None], Awaitable[Relay]],
    *,
    enabled: bool,
    render_progress: Callable[[str], bytes],
    render_error: Callable[[ModelyardError], bytes],
    body: Callable[[Relay], AsyncIterator[bytes]],
    media_type: str,
) -> Relay | Response:
    """For a streaming request: the opened relay, as without swap progress — or, when it is
    enabled and the model has to load first, a response that streams the progress and then
    `body(relay)`."""
    if not enabled:
        return await open_relay(None)
    drain.mark_answer()  # its progress stream is an answer, not a feed, for a shutdown
    opened = await relay_or_progress(open_relay)
    if isinstance(opened, Relay):
        return opened
    stream = progress_then_relay(opened, render_progress, render_error, body, upstream_message)
    return ProgressStream(stream, opened, media_type)


class ProgressStream(WatchedStream):
    """Swap progress, then the answer: a response that closes its relay however the ASGI call
    ends. The stream's own `finally` is not enough: a client that leaves before the first
    progress line went out ends the call before the stream ever started, and a stream never
    started never runs its `finally`, while the relay goes on opening."""

    def __init__(self, content: AsyncIterator[bytes], pending: Pending, media_type: str) -> None:
        super().__init__(content, media_type=media_type, headers={"Cache-Control": "no-cache"})
        self.pending = pending

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.pending.close()
