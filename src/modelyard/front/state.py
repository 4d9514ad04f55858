"""What every front handler shares: the owners of the front's parts, built once at startup
(front/app.py's lifespan) and composed here, and the small helpers every handler uses to read a
request.

The parts: the catalog (settings, models, pulls: front/catalog.py), the dispatcher (engines,
queues, leases, the relay: front/dispatch/dispatcher.py), identity (database, auth), the archive,
chat (sessions, their KV reuse, MCP servers) and ops (config reload, log buffer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
import sqlalchemy as sa
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from modelyard.errors import InvalidRequest
from modelyard.front.catalog import Catalog
from modelyard.front.dispatch.dispatcher import Dispatcher
from modelyard.front.engines.worker_states import read_states, workers_file
from modelyard.front.identity.principal import Principal, principal_of
from modelyard.front.ops.request_log import RequestLog

if TYPE_CHECKING:
    from modelyard.front.archive.store import ArchiveStore
    from modelyard.front.chat.sessions.kv import SessionKv
    from modelyard.front.chat.sessions.store import SessionStore
    from modelyard.front.chat.tools.mcp import McpHub
    from modelyard.front.identity.auth import Auth
    from modelyard.front.ops.activity import Activity
    from modelyard.front.ops.logs import LogBuffer
    from modelyard.front.ops.reload import ConfigReloader
    from modelyard.front.ops.usage import UsageRecorder

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Identity:
    """Who calls: the database of users and tokens, and the auth that reads them."""

    db: sa.Engine
    auth: Auth  # identifies callers (front/identity/auth.py)


@dataclass(frozen=True)
class Chat:
    """Server-side chat sessions, their KV reuse in the backends, and the tool loop's MCP
    servers."""

    sessions: SessionStore  # front/chat/sessions/store.py
    session_kv: SessionKv  # front/chat/sessions/kv.py
    mcp: McpHub  # front/chat/tools/mcp.py


@dataclass(frozen=True)
class Ops:
    """Running the server: config reload (POST /admin/reload, SIGHUP) and the log buffer
    (GET /admin/logs)."""

    reloader: ConfigReloader
    logs: LogBuffer
    # Finished inference requests, fanned out to usage accounting and the activity view.
    requests: RequestLog = field(default_factory=RequestLog)
    activity: Activity | None = None  # the activity view (front/ops/activity.py); a sink above
    usage: UsageRecorder | None = None  # usage accounting (GET /v1/usage), one of the sinks


@dataclass(frozen=True)
class FrontState:
    catalog: Catalog
    dispatch: Dispatcher
    identity: Identity
    archive: ArchiveStore  # generated files, transcripts (front/archive/store.py)
    chat: Chat
    ops: Ops
    started_at: float = field(default_factory=time.time)

    async def status_view(self) -> dict[str, Any]:
        """GET /status: version, uptime, every engine's status and the queues."""
        from modelyard import __version__

        return {
            "version": __version__,
            "uptime_seconds": round(time.time() - self.started_at, 3),
            "engines": [report.to_json() for report in await self.dispatch.engine_statuses()],
            "queues": self.dispatch.queues.stats(),
            "replicas": self.dispatch.replicas.stats(),
            "chat_sessions": self.chat.sessions.stats(),
            **self._workers(),
        }

    def _workers(self) -> dict[str, Any]:
        """`serve --workers N`: each worker's pid, whether it runs, its restarts and last exit
        (as the supervisor wrote them); which one answered is in X-Modelyard-Worker."""
        settings = self.catalog.settings
        if settings.worker_count <= 1:
            return {}
        return {"workers": read_states(workers_file(settings))}


# X-Modelyard-Priority's range. A queue admits strictly by priority and shares fairly only
# within one, so a caller who may raise it jumps every other user's requests: only admins may
# (up to PRIORITY_MAX); everyone else may only lower theirs (a background job yielding, as the
# batch runner's lines do at -100), down to PRIORITY_MIN. Out of range is clamped, not refused:
# the header is a wish, and clients written for an open server keep working.
PRIORITY_MIN = -1000
PRIORITY_MAX = 1000


PRIORITY_HEADER = "x-modelyard-priority"


def request_priority(request: Request) -> int:
    """`X-Modelyard-Priority: N` of a request, for its caller (`priority_for`)."""
    raw = request.headers.get(PRIORITY_HEADER)
    return 0 if raw is None else priority_for(raw, principal_of(request))


def priority_for(raw: str | None, principal: Principal) -> int:
    """`X-Modelyard-Priority: N` (`raw`; None: not sent): higher is admitted first from a
    model's queue; clamped to [PRIORITY_MIN, 0], or [PRIORITY_MIN, PRIORITY_MAX] for a caller
    with the admin scope."""
    if raw is None:
        return 0
    try:
        wished = int(raw)
    except ValueError:
        raise InvalidRequest(
            f"X-Modelyard-Priority must be an integer, not {raw!r}", param="priority"
        ) from None
    highest = PRIORITY_MAX if principal.can("admin") else 0
    return max(PRIORITY_MIN, min(highest, wished))


def state_of(request: Request) -> FrontState:
    state: FrontState = request.app.state.front
    return state


async def read_json_object(request: Request) -> dict[str, Any]:
    body = await request.body()
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    return data


def validate(model: type[M], data: dict[str, Any]) -> M:
    """Validate with pydantic; the first problem becomes a 400 naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        raise InvalidRequest(f"{where or 'body'}: {first['msg']}", param=where) from exc


def upstream_message(body: bytes) -> str:
    """The message inside an upstream error body, whatever its shape."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace")[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
    return str(data)[:500]

