"""A streamed answer that ends when its client leaves, watched by one task.

Starlette's StreamingResponse, under a server of ASGI spec 2.3 (uvicorn's), runs every stream in
an anyio task group: one task streams, another listens for the client's disconnect, and either
cancels the other through anyio's cancel scopes. For the relay's streams — every streamed chat —
that machinery cost more CPU than the stream's own first chunk. Here the stream runs in the
request's own task and one plain asyncio task listens: on `http.disconnect` it cancels the
stream where it waits (for the backend's next chunk, or the client's socket), and the response
ends as Starlette's does then — without an error, the answer incomplete (`client_closed_request`
in the request's record). A cancel from elsewhere (a shutdown's grace ending) goes through
unchanged.
"""

from __future__ import annotations

import asyncio

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class WatchedStream(StreamingResponse):
    """StreamingResponse, streamed in the caller's task while one task watches the client."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        gone = streaming = False

        async def listen() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            if streaming:  # else the stream is over: no cancel may land after it
                task.cancel()

        listener = asyncio.create_task(listen())
        streaming = True
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone or task.uncancel() > 0:  # not (only) ours: a shutdown's, say
                raise
        finally:
            streaming = False
            listener.cancel()
        if self.background is not None:
            await self.background()
