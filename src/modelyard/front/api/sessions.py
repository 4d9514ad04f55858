"""Server-side chat sessions: GET /v1/sessions, GET/DELETE /v1/sessions/{id}, DELETE /v1/sessions.

The caller sees their own sessions; admins see every one (and name another owner's session
with `?owner=NAME`). Another owner's session answers 404 `session_not_found`, like a missing one.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard.front.chat.sessions.store import SessionStore, owner_of, valid_session_id
from modelyard.front.identity.principal import Principal, principal_of
from modelyard.front.state import state_of


def _json(payload: Any) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


def store_of(request: Request) -> SessionStore:
    return state_of(request).chat.sessions


def _owner(request: Request) -> str | None:
    return request.query_params.get("owner")


def _named_owner(request: Request, principal: Principal) -> str:
    """The owner of the session a request names: `?owner=` (admins), else the caller."""
    named = _owner(request) if principal.is_admin else None
    return named or owner_of(principal)


async def list_sessions(request: Request) -> Response:
    store, principal = store_of(request), principal_of(request)
    await store.refresh_all(principal)  # several fronts or workers: as the database has them
    found = store.list_for(principal)
    return _json({"object": "list", "data": [s.view() for s in found]})


async def get_session(request: Request) -> Response:
    sid = valid_session_id(request.path_params["session_id"])
    store, principal = store_of(request), principal_of(request)
    await store.refresh(_named_owner(request, principal), sid)  # as the database has it
    session = store.find(principal, sid, _owner(request))
    return _json(session.view(with_messages=True))


async def delete_session(request: Request) -> Response:
    sid = valid_session_id(request.path_params["session_id"])
    store, principal = store_of(request), principal_of(request)
    await store.refresh(_named_owner(request, principal), sid)  # it may be another worker's
    store.delete(principal, sid, _owner(request))
    if store.shared:
        await store.flush()  # gone for the others before the answer says so
    return _json({"id": sid, "object": "chat.session.deleted", "deleted": True})


async def delete_sessions(request: Request) -> Response:
    store, principal = store_of(request), principal_of(request)
    await store.refresh_all(principal)
    count = store.delete_all(principal)
    if store.shared:
        await store.flush()
    return _json({"object": "chat.session.deleted", "deleted": count})


routes = [
    Route("/v1/sessions", list_sessions, methods=["GET"]),
    Route("/v1/sessions", delete_sessions, methods=["DELETE"]),
    Route("/v1/sessions/{session_id}", get_session, methods=["GET"]),
    Route("/v1/sessions/{session_id}", delete_session, methods=["DELETE"]),
]
