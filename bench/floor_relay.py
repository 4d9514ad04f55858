"""The cheapest Python relay: what one more hop through uvicorn and aiohttp costs on this machine.

    python bench/floor_relay.py PORT UPSTREAM_URL

bench/proxy.py runs it as its `floor` target, beside modelyard: the same stack modelyard's front
stands on (uvicorn with httptools and uvloop, an aiohttp client with a keep-alive pool), doing
nothing but read the request, send it upstream and copy the answer back chunk by chunk — no
auth, queue, lease, routing, metrics or validation. What it adds over a direct request is the
floor for any relay written on that stack; modelyard's added cost above the floor is its own.
"""

from __future__ import annotations

import sys
from typing import Any

import aiohttp
import uvicorn

HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length"}


class FloorRelay:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        assert self.session is not None
        headers = {k.decode(): v.decode() for k, v in scope["headers"]
                   if k not in HOP_BY_HOP and k != b"host"}
        async with self.session.request(scope["method"], self.upstream + scope["path"],
                                        data=body, headers=headers) as r:
            await send({"type": "http.response.start", "status": r.status, "headers": [
                (k.lower(), v) for k, v in r.raw_headers if k.lower() not in HOP_BY_HOP]})
            async for chunk in r.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    async def lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
                    auto_decompress=False)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def main() -> None:
    port, upstream = int(sys.argv[1]), sys.argv[2].rstrip("/")
    uvicorn.run(FloorRelay(upstream), host="127.0.0.1", port=port, log_level="warning",
                http="httptools", loop="uvloop", access_log=False)


if __name__ == "__main__":
    main()
