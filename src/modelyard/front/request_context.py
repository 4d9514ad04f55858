"""One request's context, decided once (DESIGN.md §3.14).

The API layer (front/api/) parses a request, and builds this from it and from what the ASGI
middleware attached (the caller from the auth gate, the limits' admission): who calls, at what
priority, in which chat session, whether its answer is archived, and the client's receive channel
(watched for a disconnect). Everything below the API layer — the chat pipeline, sessions, the
archive capture, the tool loop, the dispatcher — reads what it needs from here and never sees the
web framework's request, so nothing below recomputes the caller or re-reads a header.

The model and its upstream route are the parsed call's (front/chat/request.py `ChatCall`: the name
the client gave, the context variant it is served as); which engine serves it is the
dispatcher's decision at lease time (front/dispatch/dispatcher.py), when the queues are known.

Cost: one slotted object per request, filled with what the API layer reads anyway (its three
headers in one pass over the ASGI list: front/api/context.py); a request that names no session
and asks for no archive carries two Nones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import Receive

    from modelyard.front.archive.capture import Plan
    from modelyard.front.identity.limits_store import Admission
    from modelyard.front.identity.principal import Principal
    from modelyard.front.state import FrontState
    from modelyard.http_limits import ClientGone


@dataclass(slots=True)
class RequestContext:
    """What the API layer decided about one request; handed down instead of the request."""

    state: FrontState  # the front's parts (front/state.py)
    principal: Principal  # the caller, as the auth gate identified it (front/identity/auth.py)
    # The client's ASGI receive channel: its `http.disconnect` is how a request that waits, or a
    # non-streamed answer, learns that its client left (front/dispatch/relay.py ClientWatch).
    receive: Receive
    # Under the front's server, the signal that the client's connection was lost (the same
    # news as `http.disconnect`, without a task listening for it: modelyard/http_limits.py).
    client_gone: ClientGone | None = None
    priority: int = 0  # X-Modelyard-Priority, clamped for the caller (front/state.py)
    # The chat session the request names, validated (front/chat/sessions/store.py); None: none.
    session_id: str | None = None
    # The archive plan when the answer is to be archived (front/archive/capture.py); None: not.
    archive: Plan | None = None
    # The limits' admission (front/identity/limits.py): the slots it holds and the limit left;
    # None: no limit applies to the caller (the common case: no database work was done).
    admission: Admission | None = None
