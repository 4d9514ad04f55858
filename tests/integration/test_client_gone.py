"""The front's server tells a request when its client's connection is lost before its response
ended (`ClientGone` in the scope, modelyard/http_limits.py): what a non-streamed answer's
ClientWatch subscribes to instead of a task listening on `receive()`. A real uvicorn server with
the front's protocol, and real sockets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn

from modelyard.http_limits import CLIENT_GONE, ClientGone
from modelyard.serving import server_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

REQUEST = b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n"


class App:
    """`/slow` waits (up to 20 s) for its client to leave; `/fast` answers at once."""

    def __init__(self) -> None:
        self.signals: list[ClientGone] = []
        self.heard = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        gone = scope[CLIENT_GONE]
        self.signals.append(gone)
        if scope["path"] == "/slow":
            gone.subscribe(self.heard.set)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.heard.wait(), 20)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@contextlib.asynccontextmanager
async def serving(app: App) -> AsyncIterator[tuple[uvicorn.Server, int]]:
    server = uvicorn.Server(server_config(app, host="127.0.0.1", port=0))  # type: ignore[arg-type]
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done(), "the server did not start"
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield server, port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 20)


async def test_a_client_that_leaves_before_its_answer_is_signalled() -> None:
    app = App()
    async with serving(app) as (_, port):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST)
        await writer.drain()
        while not app.signals:
            await asyncio.sleep(0.01)  # the request reached the app
        writer.close()
        await asyncio.wait_for(app.heard.wait(), 10)
        assert app.signals[0].happened


async def test_a_client_that_leaves_after_its_answer_is_not_signalled() -> None:
    app = App()
    async with serving(app) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST.replace(b"/slow", b"/fast"))
        await writer.drain()
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        writer.close()
        while server.server_state.connections:
            await asyncio.sleep(0.01)  # the server saw the connection go
        [gone] = app.signals
        assert not gone.happened
