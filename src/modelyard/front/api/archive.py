"""The archive API (a real identity required: the auth gate's `user` class).

    GET    /archive?kind=&limit=&before=&owner=   {"items": [item, ...]} newest first
    GET    /archive/{id}                          item
    GET    /archive/{id}/content                  the bytes, as an attachment
    DELETE /archive/{id}                          {"status": "deleted"}

An item: {id, owner, kind, model, filename, media_type, size_bytes, retention, created_at,
expires_at, meta} (times in Unix seconds; expires_at null: kept until deleted). `before` pages
by created_at: pass the last item's. Owners see their own items, admins all (`owner=` narrows
an admin's list); an item you may not see is 404 archive_item_not_found, like one that is gone.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from modelyard.errors import InvalidRequest
from modelyard.front.archive.store import KINDS, MAX_LIST, ArchiveStore
from modelyard.front.identity.principal import principal_of
from modelyard.front.state import state_of


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def _store(request: Request) -> ArchiveStore:
    return state_of(request).archive


def _number(request: Request, name: str) -> float | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise InvalidRequest(f"{name}: {raw!r} is not a number", param=name)
    return value


async def list_items(request: Request) -> Response:
    params = request.query_params
    kind = params.get("kind") or None
    if kind is not None and kind not in KINDS:
        raise InvalidRequest(f"kind: {kind!r} is not one of {', '.join(KINDS)}", param="kind")
    limit = _number(request, "limit")
    if limit is not None and (not limit.is_integer() or not 1 <= limit <= MAX_LIST):
        raise InvalidRequest(f"limit: an integer from 1 to {MAX_LIST}", param="limit")
    items = await _store(request).list_items(
        principal_of(request), kind=kind, limit=int(limit or 100),
        before=_number(request, "before"), owner=params.get("owner") or None)
    return _json({"items": items})


async def get_item(request: Request) -> Response:
    return _json(await _store(request).get(principal_of(request), request.path_params["id"]))


async def item_content(request: Request) -> Response:
    item, path = await _store(request).content(principal_of(request), request.path_params["id"])
    # The name was sanitized when saved; Starlette quotes it (RFC 6266) as an attachment, and
    # nosniff keeps a browser from rendering what a service labelled as something else.
    return FileResponse(
        path, media_type=item["media_type"], filename=item["filename"],
        content_disposition_type="attachment",
        headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "private, no-store"},
    )


async def delete_item(request: Request) -> Response:
    await _store(request).delete(principal_of(request), request.path_params["id"])
    return _json({"status": "deleted"})


routes = [
    Route("/archive", list_items, methods=["GET"]),
    Route("/archive/{id}", get_item, methods=["GET"]),
    Route("/archive/{id}", delete_item, methods=["DELETE"]),
    Route("/archive/{id}/content", item_content, methods=["GET"]),
]
