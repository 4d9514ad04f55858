"""Quotas and rate limits (docs/teams.md): requests per minute, tokens per day and concurrent
requests per token, user or group, held for every front sharing the database.

Which limits a request is held to (`Limiter.rules_for`), each counted on its own:
- `token:<id>`: the token it came with;
- the user (counted as `user:<name>`, anonymous callers together as `anonymous`): each field of
  the `user:<name>` row, or of `default` where that row has none;
- `group:<name>`: the user's group, one pool shared by its members.
A request must pass all of them. The limits table is cached in memory (reread every
`limits_refresh_s`, at once after an edit here), so a caller no limit applies to costs no
database work; one that is limited costs one transaction when it starts
(limits_store.admit) and, with `max_concurrent`, one when it ends. Tokens per day count every
prompt and completion token of a finished request (from the request log), added to the
database by a background task every half second; a request is refused once the day's count
reached the quota (the request that crosses it finishes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from starlette.types import Scope

from modelyard.errors import rate_limit_headers
from modelyard.front.identity import limits_store as store
from modelyard.front.identity.limits_store import Admission, Limit, Rule, Windows
from modelyard.front.identity.principal import Principal
from modelyard.front.ops.metrics import API_OF_PATH
from modelyard.front.ops.request_log import RequestRecord

log = logging.getLogger(__name__)

# The routes limits apply to: every generating route (POST).
LIMITED_PATHS = frozenset({*API_OF_PATH, "/v1/responses"})
ANONYMOUS = "anonymous"
# Where the edge's limits step leaves a limited request's admission for the API layer's request
# context (front/api/context.py); absent: no limit applied (no database work was done).
ADMISSION_KEY = "modelyard.admission"
_FLUSH_S = 0.5
_PRUNE_S = 300.0


def _user_subject(user: str | None) -> str:
    return ANONYMOUS if user is None else f"user:{user}"


class Limiter:
    """This front's view of the limits and its side of the shared counters."""

    def __init__(self, database: sa.Engine, refresh_s: float, *,
                 clock: Callable[[], float] = time.time, windows: Windows = Windows()) -> None:
        self.db = database
        self.refresh_s = refresh_s
        self.clock = clock  # tests move it to end a window
        self.windows = windows
        self.front_id = secrets.token_hex(8)
        self._table: dict[str, Limit] = {}
        self._groups: dict[str, str | None] = {}  # user → group, as their requests said
        self._tokens: dict[str, int] = {}  # subject → tokens not yet added to the database
        self._running = 0  # requests holding slots here
        self._task: asyncio.Task[None] | None = None

    # ---- the cached table -------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return bool(self._table)

    async def refresh(self) -> None:
        rows = await asyncio.to_thread(store.list_limits, self.db)
        self._table = {row.subject: row for row in rows}

    def rules_for(self, principal: Principal | None) -> list[Rule]:
        table = self._table
        if not table:
            return []
        user = None if principal is None else principal.user
        rules = []
        token_id = None if principal is None else principal.token_id
        if token_id is not None and (row := table.get(f"token:{token_id}")) is not None:
            rules.append(Rule(row.subject, row.requests_per_minute, row.tokens_per_day,
                              row.max_concurrent))
        own = table.get(f"user:{user}") if user is not None else None
        default = table.get(store.DEFAULT)
        values = [_first(own, default, name) for name in store.FIELDS]
        rules.append(Rule(_user_subject(user), *values))
        group = None if principal is None else principal.group
        if user is not None:
            self._groups[user] = group  # for the tokens of its answer (on_record)
        if group is not None and (row := table.get(f"group:{group}")) is not None:
            rules.append(Rule(row.subject, row.requests_per_minute, row.tokens_per_day,
                              row.max_concurrent))
        return [rule for rule in rules if not rule.empty]

    def max_num_ctx(self, principal: Principal | None) -> int | None:
        """The largest Ollama `num_ctx` the caller may ask beyond a model's served context: the
        tightest of its token's, its user's (else `default`'s) and its group's `max_num_ctx`;
        None: no limit of its own. Read from the cached table: no database work."""
        table = self._table
        if not table:
            return None
        user = None if principal is None else principal.user
        token_id = None if principal is None else principal.token_id
        group = None if principal is None else principal.group
        own = table.get(f"user:{user}") if user is not None else None
        found = [_first(own, table.get(store.DEFAULT), "max_num_ctx")]
        for subject in (token_id and f"token:{token_id}", group and f"group:{group}"):
            row = table.get(subject) if subject else None
            found.append(None if row is None else row.max_num_ctx)
        caps = [cap for cap in found if cap is not None]
        return min(caps) if caps else None

    # ---- a request -------------------------------------------------------------------------

    async def admit(self, rules: list[Rule]) -> Admission:
        slot_id = secrets.token_hex(8)
        admission = await asyncio.to_thread(store.admit, self.db, rules, now=self.clock(),
                                            front_id=self.front_id, slot_id=slot_id,
                                            windows=self.windows)
        if admission.slots:
            self._running += 1
        return admission

    async def release(self, admission: Admission) -> None:
        if admission.slots:
            self._running -= 1
            await asyncio.to_thread(store.release, self.db, admission.slots)

    def on_record(self, record: RequestRecord) -> None:
        """A request log sink: no I/O here, the tokens wait for `flush`."""
        spent = record.prompt_tokens + record.completion_tokens
        if spent <= 0 or not self._table:
            return
        principal = Principal(record.user, False, frozenset(), "token", record.token_id,
                              group=self._groups.get(record.user or ""))
        for rule in self.rules_for(principal):
            if rule.tokens_per_day is not None:
                self._tokens[rule.subject] = self._tokens.get(rule.subject, 0) + spent

    async def flush(self) -> None:
        """Adds the tokens of finished requests to the shared counters."""
        pending, self._tokens = self._tokens, {}
        if pending:
            await asyncio.to_thread(store.add_tokens, self.db, pending, self.clock(),
                                    self.windows)

    # ---- background work -------------------------------------------------------------------

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="limits")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self.flush()

    async def _loop(self) -> None:
        last_refresh = last_keep = last_prune = time.monotonic()
        while True:
            await asyncio.sleep(_FLUSH_S)
            now = time.monotonic()
            try:
                await self.flush()
                if now - last_refresh >= self.refresh_s:
                    last_refresh = now
                    await self.refresh()
                if self._running and now - last_keep >= self.windows.slot_ttl_s / 3:
                    last_keep = now
                    await asyncio.to_thread(store.keep_slots, self.db, self.front_id,
                                            self.clock() + self.windows.slot_ttl_s)
                if now - last_prune >= _PRUNE_S:
                    last_prune = now
                    await asyncio.to_thread(store.prune, self.db, self.clock(), self.windows)
            except Exception:  # a database hiccup: try again next round
                log.exception("limits: background update failed")


def _first(own: Limit | None, default: Limit | None, name: str) -> Any:
    value = getattr(own, name) if own is not None else None
    return getattr(default, name) if value is None and default is not None else value


async def admit(scope: Scope) -> tuple[Limiter, Admission, dict[str, str]] | None:
    """The edge's limits step (front/api/edge.py), after the auth gate: None when no limit applies
    to this request (the common case, no database work at all); else its admission, to be
    released when the request ends (also left in the scope, under ADMISSION_KEY, for the
    request's context: front/api/context.py), and the X-RateLimit-* headers for its answer. A
    request over a limit raises RateLimited (429 rate_limited)."""
    if scope["method"] != "POST" or scope["path"] not in LIMITED_PATHS:
        return None
    limiter: Limiter | None = getattr(scope["app"].state, "limits", None)
    rules = limiter.rules_for(scope.get("modelyard.principal")) if limiter else []
    if limiter is None or not rules:
        return None
    admission = scope[ADMISSION_KEY] = await limiter.admit(rules)
    extra = ({} if admission.limit is None else
             rate_limit_headers(admission.limit, admission.remaining, admission.reset_s))
    return limiter, admission, extra
