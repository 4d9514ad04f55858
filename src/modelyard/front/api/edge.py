"""The front's edge: the one ASGI layer between the HTTP server and the routes.

Every request passes the same steps, in this order (each module keeps its own logic):

1. the drain knows it is in flight (front/dispatch/drain.py: a shutdown's grace, then an error);
2. its request id (request_ids.py), answered in X-Request-Id, even on a refusal;
3. an inference request is counted and timed (front/ops/metrics.py `Metered`);
4. CORS, only for a request that carries an Origin (front/identity/cors.py);
5. the caller (front/identity/auth.py `AuthGate`): Host, body limit, identity, policy;
6. its limits, when any apply (front/identity/limits.py `admit`);
7. a plain OpenAI chat or embedding is answered by its lane (front/api/lane.py), without the
   framework; any other request (one the lane finds not plain included, its body replayed)
   goes to its route;
8. the route, with the exception handlers: a ModelyardError is answered in its API's shape
   (the routes' endpoints run without Starlette's own per-route exception layer:
   `endpoint_app`).

Why one layer rather than a middleware per step: each ASGI middleware is another coroutine per
request and another `send` wrapper per message, so six of them (and Starlette's two exception
layers) cost the front about a quarter of its CPU per request, and every streamed chunk went
through eight wrappers. Here a request's answer passes one wrapper (two for a limited caller).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Router
from starlette.types import ASGIApp, ExceptionHandler, Message, Receive, Scope, Send

from modelyard.config import Settings
from modelyard.errors import ModelyardError
from modelyard.front.api.lane import Lanes
from modelyard.front.dispatch.drain import Drain, InFlight, in_flight
from modelyard.front.identity import limits
from modelyard.front.identity.auth import AuthGate
from modelyard.front.identity.cors import OllamaCors
from modelyard.front.identity.principal import CURRENT_PRINCIPAL
from modelyard.front.ops.metrics import Metered
from modelyard.front.render import error_response
from modelyard.metrics import current
from modelyard.request_ids import HEADER, REQUEST_ID, accept

_REQUEST_ID = b"x-request-id"
_ORIGIN = b"origin"
_ANSWER_HEADERS = "modelyard.answer_headers"  # headers the edge adds to the answer (scope key)
_NONE: dict[str, str] = {}


class Edge:
    def __init__(
        self,
        router: Router,
        settings: Settings,
        drain: Drain,
        handlers: dict[Any, ExceptionHandler],
    ) -> None:
        self.router = router
        self.drain = drain
        self.gate = AuthGate(settings)
        self.cors = OllamaCors(self._gated, settings)
        self.handlers = handlers
        self.lanes = Lanes()  # plain OpenAI chats and embeddings, without the framework
        # The exceptions with a handler of their own (a catch-all `Exception` is not one).
        self._handled = tuple(k for k in handlers if isinstance(k, type) and k is not Exception)
        # What Starlette's routes look up for the exceptions their endpoints raise.
        routed = {k: v for k, v in handlers.items() if k is not Exception}
        self._route_handlers: tuple[dict[Any, ExceptionHandler], dict[int, Any]] = (routed, {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.router(scope, receive, send)
            return
        record, entered = self.drain.enter(scope["path"])
        try:
            await self._identified(scope, receive, send, record)
        except asyncio.CancelledError:
            if not record.ended_by_drain:
                raise
            await self.drain.end(record, scope, receive, send)
        finally:
            self.drain.leave(record, entered)

    async def _identified(self, scope: Scope, receive: Receive, send: Send,
                          record: InFlight) -> None:
        offered = origin = None
        for name, value in scope["headers"]:
            if name == _REQUEST_ID:
                offered = value.decode("latin-1")
            elif name == _ORIGIN:
                origin = value
        rid = accept(offered)
        rid_set = REQUEST_ID.set(rid)
        metered = Metered.start(scope)
        if metered is not None:
            receive = metered.receive(receive)

        async def answer(message: Message) -> None:
            if message["type"] == "http.response.start":
                Drain.started(record, message)
                headers = MutableHeaders(scope=message)
                headers[HEADER] = rid
                # A limited caller's X-RateLimit-* (_gated): added here, not by one more
                # wrapper every chunk of a stream would pass.
                for name, value in scope.get(_ANSWER_HEADERS, _NONE).items():
                    headers[name] = value
            if metered is not None:
                metered.on_send(message)
            await send(message)

        try:
            if origin is None:
                await self._gated(scope, receive, answer)
            else:  # a browser's request: its preflight, or CORS headers on the answer
                await self.cors(scope, receive, answer)
        except BaseException as exc:
            if metered is not None:
                metered.finish(exc)
            raise
        else:
            if metered is not None:
                metered.finish()
        finally:
            REQUEST_ID.reset(rid_set)

    async def _gated(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The caller and its limits, then the route."""
        try:
            receive = await self.gate.admit(scope, receive)
            admitted = await limits.admit(scope)
        except ModelyardError as exc:
            await error_response(scope["path"], exc)(scope, receive, send)
            return
        owner = CURRENT_PRINCIPAL.set(scope["modelyard.principal"])
        if (record := current.get()) is not None:
            record.on_admitted()  # the request's `admitted` event
        try:
            if admitted is None:  # the common case: no limit applies
                await self._routed(scope, receive, send)
                return
            limiter, admission, extra = admitted
            scope[_ANSWER_HEADERS] = extra
            try:
                await self._routed(scope, receive, send)
            finally:
                if admission.slots:
                    limiter.release(admission)
        finally:
            CURRENT_PRINCIPAL.reset(owner)

    async def _routed(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The route; an exception it raises before its answer began is answered by its
        handler. One with no handler of its own (a bug) is answered 500 and raised again, for
        the server to log, as Starlette's ServerErrorMiddleware does."""
        scope["starlette.exception_handlers"] = self._route_handlers
        try:
            lane = self.lanes.get(scope["path"]) if scope["method"] == "POST" else None
            if lane is not None:  # a plain request is answered there; another goes on
                replayed = await lane(scope, receive, send)
                if replayed is None:
                    return
                receive = replayed
            await self.router(scope, receive, send)
        except Exception as exc:
            handler = _handler_for(self.handlers, exc)
            current = in_flight()
            if handler is None or (current is not None and current.started):
                raise
            response = await handler(Request(scope, receive), exc)
            if response is not None:
                await response(scope, receive, send)
            if not isinstance(exc, self._handled):
                raise


def endpoint_app(endpoint: Callable[[Request], Awaitable[Response]]) -> ASGIApp:
    """A route's endpoint as an ASGI app, without Starlette's per-route exception layer (its
    own `send` wrapper and try): the edge answers what an endpoint raises, with the same
    handlers."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        response = await endpoint(Request(scope, receive, send))
        await response(scope, receive, send)

    return app


def _handler_for(handlers: dict[Any, ExceptionHandler], exc: Exception) -> Any:
    for cls in type(exc).__mro__:
        if cls in handlers:
            return handlers[cls]
    return None


