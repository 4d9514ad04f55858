"""Running an ASGI app under uvicorn the way modelyard's processes stop (front and engines).

The first SIGTERM or SIGINT shuts down gracefully: uvicorn stops accepting, `on_shutdown` runs
(the front's drain starts its grace), requests in flight get up to `grace_s` to finish (plus a
margin for the ones the drain ended to say so), then the app's lifespan teardown stops what it
started. A second signal, either kind, forces the exit at once: every process below this one is
SIGKILLed (whole groups), so nothing is left orphaned, and the process exits without cleanup.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Protocol

import uvicorn
from starlette.types import ASGIApp

from modelyard.config import Settings
from modelyard.http_limits import HttpLimits, protocol_class
from modelyard.proc.process import kill_process_tree

# After the grace, what streams the drain ended may take to send their last event and close.
ABORT_MARGIN_S = 5.0
STARTUP_FAILURE = 3

# How long the front pools an idle connection to an engine, and how long an engine keeps one:
# longer, so the engine never closes a connection the front is about to reuse (with uvicorn's
# 5 s default, a call landing as the engine closed it failed as 503 engine_unavailable, and a
# health probe as RemoteProtocolError).
ENGINE_CLIENT_KEEPALIVE_S = 60.0
ENGINE_SERVER_KEEPALIVE_S = ENGINE_CLIENT_KEEPALIVE_S + 15.0
PUBLIC_KEEPALIVE_S = 5.0  # uvicorn's default, for clients we do not know


# The cyclic garbage collector, tuned for a server. What the process built to start (settings,
# routes, the catalog, imported modules) lives as long as it does, so once it serves it is
# frozen out of every collection: a full collection of the front's heap took 130-150 ms, about
# one per 6,000 one-token chats, and 8 ms frozen. Young collections every 2,000 allocations
# rather than Python's 700: fewer, each a little longer. Measured in the front under 6,000
# one-token chats at c=16 (gc.callbacks): 58-70 µs of collection per request before, 23-26 after.
# Garbage without cycles is freed at once, as always.
GC_THRESHOLDS = (2_000, 10, 10)


class GracefulServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, *, on_shutdown: Callable[[], None] | None = None,
        hooks: ServerHooks | None = None,
    ) -> None:
        super().__init__(config)
        self.on_shutdown = on_shutdown
        self.hooks = hooks

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            # The start's objects, garbage included (a one-off, bounded), are never scanned
            # again (GC_THRESHOLDS); no collection first: it would pause the server it started.
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLDS)
        if self.hooks is not None and self.started and not self.should_exit:
            await self.hooks.started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:  # the second signal (uvicorn alone forces only on SIGINT)
            force_exit(sig)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.on_shutdown is not None:
            self.on_shutdown()
        if self.hooks is not None:
            self.hooks.stopping()
        await super().shutdown(sockets)
        if self.hooks is not None:
            await self.hooks.stopped()


class ServerHooks(Protocol):
    """What runs beside a server (a `serve --workers N` supervisor's worker processes)."""

    async def started(self) -> None:
        """The server accepts: start what goes beside it."""

    def stopping(self) -> None:
        """The first signal: tell them to stop too (they drain as this server does)."""

    async def stopped(self) -> None:
        """This server has drained: wait until they have too."""


def force_exit(sig: int) -> None:
    """Kill every descendant (and their groups), then leave now (called from a handler)."""
    with contextlib.suppress(OSError):
        os.write(2, f"modelyard: second signal ({signal.Signals(sig).name}): killing child "
                    "processes and exiting now\n".encode())
    kill_process_tree(os.getpid(), include_root=False)
    os._exit(128 + sig)


def http_limits(settings: Settings) -> HttpLimits:
    """The limits every port of this server applies (front and engines alike)."""
    return HttpLimits(
        max_header_bytes=settings.max_header_bytes,
        max_header_count=settings.max_header_count,
        header_read_timeout_s=settings.header_read_timeout_s,
        body_read_timeout_s=settings.body_read_timeout_s,
    )


def server_config(
    app: ASGIApp,
    *,
    host: str,
    port: int,
    grace_s: float | None = None,
    keep_alive_s: float = PUBLIC_KEEPALIVE_S,
    limits: HttpLimits | None = None,
    forwarded_allow_ips: Sequence[str] = (),
    headers: Sequence[tuple[str, str]] = (),
) -> uvicorn.Config:
    """uvicorn's configuration for `run`. X-Forwarded-For/-Proto are believed only from the
    peers in `forwarded_allow_ips` (the `forwarded_allow_ips` setting; engines: none):
    uvicorn's own default trusts 127.0.0.1 (or $FORWARDED_ALLOW_IPS), which on a loopback
    server let any local client choose the address the login throttle counts."""
    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False,
        http=protocol_class(limits or HttpLimits()),
        timeout_graceful_shutdown=None if grace_s is None else math.ceil(grace_s + ABORT_MARGIN_S),
        timeout_keep_alive=math.ceil(keep_alive_s),
        proxy_headers=bool(forwarded_allow_ips),
        forwarded_allow_ips=list(forwarded_allow_ips),
        headers=list(headers),
    )


def run(
    app: ASGIApp,
    *,
    host: str,
    port: int,
    grace_s: float | None = None,
    on_shutdown: Callable[[], None] | None = None,
    keep_alive_s: float = PUBLIC_KEEPALIVE_S,
    limits: HttpLimits | None = None,
    forwarded_allow_ips: Sequence[str] = (),
    sockets: Sequence[socket.socket] = (),
    hooks: ServerHooks | None = None,
    headers: Sequence[tuple[str, str]] = (),
) -> None:
    """Serve `app` until a signal; see the module's docstring. `grace_s` None waits for
    requests in flight without a bound (an engine: its front bounds it); `keep_alive_s`: how
    long an idle client connection stays open; `limits`: head size and read timeouts
    (http_limits.py); `forwarded_allow_ips`: see `server_config`; `sockets`: listening
    sockets already bound (a worker's), instead of binding `host:port`; `hooks`: what runs
    beside the server; `headers`: added to every response."""
    config = server_config(app, host=host, port=port, grace_s=grace_s,
                           keep_alive_s=keep_alive_s, limits=limits,
                           forwarded_allow_ips=forwarded_allow_ips, headers=headers)
    server = GracefulServer(config, on_shutdown=on_shutdown, hooks=hooks)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the SIGINT it handled
        server.run(sockets=list(sockets) or None)
    if not server.started:
        sys.exit(STARTUP_FAILURE)
