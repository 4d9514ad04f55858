"""Quotas and rate limits, and users' groups (admin routes; docs/teams.md).

    GET    /admin/limits              every limit, with what its counters hold now
    PUT    /admin/limits/{subject}    {"requests_per_minute", "tokens_per_day", "max_concurrent",
                                       "max_num_ctx"}
                                      (each a count or null: no limit; a missing one is null)
    DELETE /admin/limits/{subject}
    PATCH  /admin/users/{name}        {"group": "research"} (null: no group)

A subject is `token:<id>`, `user:<name>`, `group:<name>` or `default`. An edit here applies on
this front at once and on the others within `limits_refresh_s`.
"""

from __future__ import annotations

import asyncio

import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard.front.identity import accounts
from modelyard.front.identity import limits_store as store
from modelyard.front.identity.limits import ANONYMOUS, Limiter
from modelyard.front.identity.principal import principal_of
from modelyard.front.state import read_json_object, state_of, validate


def _json(payload: object, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def _limiter(request: Request) -> Limiter:
    limiter = getattr(request.app.state, "limits", None)
    assert isinstance(limiter, Limiter)  # the lifespan makes it
    return limiter


class LimitValues(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests_per_minute: int | None = Field(None, ge=0, description="null: no limit")
    tokens_per_day: int | None = Field(
        None, ge=0, description="prompt + completion tokens per UTC day; null: no limit")
    max_concurrent: int | None = Field(None, ge=0, description="null: no limit")
    max_num_ctx: int | None = Field(
        None, ge=0, description="the largest Ollama num_ctx beyond a model's served context (a "
        "context variant: a server of its own); 0: never beyond; null: no limit")


class GroupChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    group: str | None = Field(description="the user's group; null: none")


async def list_limits(request: Request) -> Response:
    limiter = _limiter(request)
    rows = await asyncio.to_thread(store.list_limits, limiter.db)
    # The `default` row is counted per user: its counters are the users'.
    counted = [r.subject for r in rows if r.subject != store.DEFAULT] + [ANONYMOUS]
    now = limiter.clock()
    usage = await asyncio.to_thread(store.usage, limiter.db, counted, now, limiter.windows)
    return _json({"limits": [{**r.public(), "usage": usage.get(r.subject)} for r in rows]})


async def put_limit(request: Request) -> Response:
    limiter = _limiter(request)
    subject = store.check_subject(request.path_params["subject"])
    req = validate(LimitValues, await read_json_object(request))
    limit = await asyncio.to_thread(
        store.set_limit, limiter.db, subject, requests_per_minute=req.requests_per_minute,
        tokens_per_day=req.tokens_per_day, max_concurrent=req.max_concurrent,
        by=principal_of(request).user, max_num_ctx=req.max_num_ctx)
    await limiter.refresh()
    return _json(limit.public())


async def delete_limit(request: Request) -> Response:
    limiter = _limiter(request)
    subject = request.path_params["subject"]
    await asyncio.to_thread(store.remove_limit, limiter.db, subject)
    await limiter.refresh()
    return _json({"status": "removed", "subject": subject})


async def set_group(request: Request) -> Response:
    auth = state_of(request).identity.auth
    name = request.path_params["name"]
    req = validate(GroupChange, await read_json_object(request))
    await asyncio.to_thread(accounts.set_group, auth.db, name, req.group)
    auth.forget_tokens()  # a token's principal carries its owner's group
    user = await asyncio.to_thread(accounts.get_user, auth.db, name)
    assert user is not None
    return _json(user.public())


routes = [
    Route("/admin/limits", list_limits, methods=["GET"]),
    Route("/admin/limits/{subject}", put_limit, methods=["PUT"]),
    Route("/admin/limits/{subject}", delete_limit, methods=["DELETE"]),
    Route("/admin/users/{name}", set_group, methods=["PATCH"]),
]
