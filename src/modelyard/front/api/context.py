"""The API layer builds each request's context (front/request_context.py) here, once: the only
place that reads the caller the auth gate attached, the limits' admission and the headers the
context is made of (X-Modelyard-Priority, X-Session-Id, X-Modelyard-Archive). Below the API
layer nothing takes the web framework's request (tests/unit/test_request_context_rule.py).
"""

from __future__ import annotations

from starlette.requests import Request

from modelyard.front.archive.capture import HEADER as ARCHIVE_HEADER
from modelyard.front.archive.capture import plan_for
from modelyard.front.chat.request import ChatCall
from modelyard.front.chat.sessions.relay import session_id_for
from modelyard.front.chat.sessions.store import HEADER as SESSION_HEADER
from modelyard.front.identity.limits import ADMISSION_KEY
from modelyard.front.identity.principal import principal_of
from modelyard.front.request_context import RequestContext
from modelyard.front.state import PRIORITY_HEADER, priority_for, state_of
from modelyard.http_limits import CLIENT_GONE

# The headers a context is made of, as ASGI hands them (names lowercased), and their place in
# `_read_headers`' answer: one pass over the raw list, not a parsed Headers object and a scan
# per name.
_PRIORITY, _SESSION, _ARCHIVE = 0, 1, 2
_WANTED = {PRIORITY_HEADER.encode(): _PRIORITY, SESSION_HEADER.encode(): _SESSION,
           ARCHIVE_HEADER.encode(): _ARCHIVE}


def _read_headers(request: Request) -> list[str | None]:
    """X-Modelyard-Priority, X-Session-Id and X-Modelyard-Archive (None: not sent; the first
    when sent twice, as Starlette's `headers.get`)."""
    found: list[str | None] = [None, None, None]
    for name, value in request.scope["headers"]:
        at = _WANTED.get(name)
        if at is not None and found[at] is None:
            found[at] = value.decode("latin-1")
    return found


def context_of(request: Request) -> RequestContext:
    """A request's context without a session or an archive plan (embeddings, rerank, scoring,
    count_tokens, services): the caller, its priority, the client's channel."""
    return _context(request, _read_headers(request))


def _context(request: Request, headers: list[str | None]) -> RequestContext:
    principal = principal_of(request)
    return RequestContext(
        state_of(request), principal, request.receive, request.scope.get(CLIENT_GONE),
        priority=priority_for(headers[_PRIORITY], principal),
        admission=request.scope.get(ADMISSION_KEY),
    )


def chat_context(request: Request, call: ChatCall, ctx: RequestContext | None = None
                 ) -> RequestContext:
    """The context of a chat or completion its API parsed into `call` (`ctx`: the one
    `context_of` made earlier, completed here): also the session it names (a chat only) and
    the archive plan when it asks for one (header or `archive` field; the header wins)."""
    headers = _read_headers(request)
    if ctx is None:
        ctx = _context(request, headers)
    ctx.session_id = session_id_for(headers[_SESSION], call.own_fields, chat=call.chat)
    ctx.archive = plan_for(ctx.state.archive, ctx.principal, headers[_ARCHIVE],
                           default_on=False, body_value=call.archive)
    return ctx
