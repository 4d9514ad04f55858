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


def context_of(request: Request) -> RequestContext:
    """A request's context without a session or an archive plan (embeddings, rerank, scoring,
    count_tokens): the caller, its priority, the client's channel."""
    principal = principal_of(request)
    return RequestContext(
        state_of(request), principal, request.receive,
        priority=priority_for(request.headers.get(PRIORITY_HEADER), principal),
        admission=request.scope.get(ADMISSION_KEY),
    )


def chat_context(request: Request, call: ChatCall, ctx: RequestContext | None = None
                 ) -> RequestContext:
    """The context of a chat or completion its API parsed into `call` (`ctx`: the one
    `context_of` made earlier, completed here): also the session it names (a chat only) and
    the archive plan when it asks for one (header or `archive` field; the header wins)."""
    if ctx is None:
        ctx = context_of(request)
    headers = request.headers
    ctx.session_id = session_id_for(headers.get(SESSION_HEADER), call.own_fields,
                                    chat=call.chat)
    ctx.archive = plan_for(ctx.state.archive, ctx.principal, headers.get(ARCHIVE_HEADER),
                           default_on=False, body_value=call.archive)
    return ctx
