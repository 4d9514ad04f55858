"""The activity view (front/ops/activity.py): recent inference requests, live.

    GET /activity?limit=&model=&owner=&status=&api=
        {"requests": [row, ...] newest first, "in_flight": [live row, ...] oldest first,
         "capture_bodies": bool}
        row: {id, time, owner, token_id, model, api, path, status, prompt_tokens,
              cached_tokens, completion_tokens, ttft_s, tokens_per_s, duration_s,
              queue_wait_s, swapped, batch_id, capture_id}
        live row: {id, time, owner, token_id, model, api, path, state ("waiting"|"answering"),
                   elapsed_s, queue_wait_s, swapped, batch_id}
        `status`: ok | error | an exact status ("200", "429", an in-band error code).
    GET /activity/stream?model=&owner=&status=&api=
        text/event-stream: `data: <row>` per request as it finishes; `: keepalive` when idle.
        A client that falls `FEED_QUEUE_ROWS` rows behind is dropped (the stream ends; an
        EventSource reconnects and reads GET /activity for what it missed).

Route class `user` (front/identity/auth.py): any real identity, an inference token included.
Admins see every request; anyone else only their own user's; `owner=` of someone else is an
empty list for them, not an error (as with the archive, nothing to probe).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from modelyard.errors import InvalidRequest
from modelyard.front.identity.principal import principal_of
from modelyard.front.ops.activity import Activity, Filters
from modelyard.front.sse import sse_event
from modelyard.front.state import state_of

DEFAULT_LIMIT = 200
KEEPALIVE_S = 15.0


def activity_of(request: Request) -> Activity:
    activity = state_of(request).ops.activity
    assert activity is not None  # the lifespan always builds it
    return activity


def _filters(request: Request) -> Filters:
    params = request.query_params
    return Filters(model=params.get("model") or None, owner=params.get("owner") or None,
                   status=params.get("status") or None, api=params.get("api") or None)


def _limit(request: Request, most: int) -> int:
    raw = request.query_params.get("limit")
    if raw is None or raw == "":
        return min(DEFAULT_LIMIT, most)
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"`limit` must be an integer, not {raw!r}", param="limit") from None
    if not 1 <= value <= most:
        raise InvalidRequest(f"`limit` must be between 1 and {most}", param="limit")
    return value


async def list_activity(request: Request) -> Response:
    state = state_of(request)
    activity = activity_of(request)
    principal, filters = principal_of(request), _filters(request)
    settings = state.catalog.settings
    limit = _limit(request, settings.activity_max_entries)
    body = {
        "requests": activity.recent(principal, filters, limit),
        "in_flight": activity.in_flight(principal, filters),
        "capture_bodies": settings.activity_capture_bodies,
    }
    return Response(orjson.dumps(body), media_type="application/json")


async def stream_activity(request: Request) -> Response:
    activity = activity_of(request)
    feed = activity.subscribe(principal_of(request), _filters(request))

    async def events() -> AsyncIterator[bytes]:
        try:
            yield b": following\n\n"  # the headers go out now
            while not feed.dropped:
                row = await feed.next(KEEPALIVE_S)
                if feed.dropped or await request.is_disconnected():
                    return
                yield b": keepalive\n\n" if row is None else sse_event(row)
        finally:
            activity.unsubscribe(feed)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


routes = [
    Route("/activity", list_activity, methods=["GET"]),
    Route("/activity/stream", stream_activity, methods=["GET"]),
]
