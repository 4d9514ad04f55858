"""Quotas and rate limits (docs/teams.md): requests per minute, tokens per day and concurrent
requests per token, user or group, held for every front sharing the database.

Which limits a request is held to (`Limiter.rules_for`), each counted on its own:
- `token:<id>`: the token it came with;
- the user (counted as `user:<name>`, anonymous callers together as `anonymous`): each field of
  the `user:<name>` row, or of `default` where that row has none;
- `group:<name>`: the user's group, one pool shared by its members.
A request must pass all of them. The limits table is cached in memory (reread every
`limits_refresh_s`, at once after an edit here), so a caller no limit applies to costs no
database work.

A limited caller costs no database work per request either, in the common case: each front
holds a share of each subject's limits in memory (`_Share`) and goes to the database ahead of
need, in batches (limits_store.py holds what every front agrees on):
- requests per minute: the front reserves a chunk of the minute's requests (the counter never
  passes the limit) and admits from it; the chunk doubles while reservations come within a
  second of each other (up to `_CHUNK_MAX`, and a sixteenth of the limit), and a new one is
  taken in the background when a quarter of it is left. What a front reserved and did not use
  by the minute's end is lost: a caller may be refused up to one chunk per front early, never
  late.
- tokens per day: finished requests' tokens are added every `_FLUSH_S`, and the day's counters
  (every front's tokens) read back then; a request is refused once the count, with this
  front's tokens not added yet, reached the quota (the request that crosses it finishes). A
  front sees another's tokens within about two flushes.
- max_concurrent: the front holds slots in the database while its requests use them, takes one
  when all it holds are busy, and gives back those no request used for a whole `_FLUSH_S`.
The first request of a subject's minute (or after a while idle) waits for one transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from starlette.types import Scope

from modelyard.errors import RateLimited, rate_limit_headers
from modelyard.front.identity import limits_store as store
from modelyard.front.identity.limits_store import Admission, Ask, Grant, Limit, Rule, Windows
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
# A front's reservation of a minute's requests: at most this many, and at most 1/_CHUNK_SHARE of
# the limit, so what fronts reserved and left unused (a caller refused early) stays small.
_CHUNK_MAX = 64
_CHUNK_SHARE = 16
# The day's token count read more than this long ago is read again before a request is let
# through on it (the background flush rereads it for the subjects in use).
_DAY_FRESH_S = 2.0
_IDLE_S = 600.0  # a subject unused this long is forgotten here (nothing held, nothing pending)


def _user_subject(user: str | None) -> str:
    return ANONYMOUS if user is None else f"user:{user}"


@dataclass
class _Share:
    """One subject's share of its limits on this front."""

    # requests per minute
    minute: int = -1  # the window `allowance` was reserved in
    allowance: int = 0  # reserved in the database, not used yet
    counted: int = 0  # the minute's shared counter after this front's last reservation
    spent: int | None = None  # the counter reached this limit: none left this minute
    chunk: int = 1  # the next reservation's size
    reserved_at: float = -math.inf  # monotonic
    refilling: bool = False
    # tokens per day
    day: int = -1  # the day `day_tokens` was read for
    day_tokens: int = 0  # every front's tokens added to the counter, as read
    day_read_at: float = -math.inf  # monotonic
    pending: int = 0  # this front's finished requests' tokens, not added yet
    flushing: int = 0  # being added
    # concurrency
    slots: list[str] = field(default_factory=list)  # held in the database
    slots_limit: int | None = None  # the max_concurrent they were taken under
    max_concurrent: int | None = None  # the one requests were last held to
    running: int = 0
    peak: int = 0  # the most running since the last give-back
    used_at: float = 0.0  # monotonic

    def roll(self, minute: int) -> None:
        if minute != self.minute:  # a new minute: last minute's reservation is void
            self.minute, self.allowance, self.counted, self.spent = minute, 0, 0, None

    def chunk_for(self, limit: int) -> int:
        return max(1, min(self.chunk, limit // _CHUNK_SHARE))

    @property
    def day_used(self) -> int:
        return self.day_tokens + self.pending + self.flushing

    @property
    def idle(self) -> bool:
        return not (self.running or self.slots or self.pending or self.flushing
                    or self.refilling)


class Limiter:
    """This front's view of the limits and its share of the shared counters."""

    def __init__(self, database: sa.Engine, refresh_s: float, *,
                 clock: Callable[[], float] = time.time, windows: Windows = Windows()) -> None:
        self.db = database
        self.refresh_s = refresh_s
        self.clock = clock  # tests move it to end a window
        self.windows = windows
        self.front_id = secrets.token_hex(8)
        self._table: dict[str, Limit] = {}
        self._groups: dict[str, str | None] = {}  # user → group, as their requests said
        self._shares: dict[str, _Share] = {}
        self._lock = asyncio.Lock()  # one reservation at a time
        self._refills: set[asyncio.Task[None]] = set()
        self._unreleased: list[str] = []  # slots to give back (a failed attempt: again)
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
        """Lets the request through on this front's shares, going to the database only for
        what they lack; raises RateLimited (and takes nothing) when a limit refuses it."""
        shares = [self._share(rule.subject) for rule in rules]
        if not self._asks(rules, shares):
            return self._take(rules, shares)  # the common case
        async with self._lock:
            # Asked again after each wait: meanwhile another request's reservation may have
            # covered this one, or other requests used what this one's covered.
            while asks := self._asks(rules, shares):
                await self._reserve(asks)
            return self._take(rules, shares)

    def release(self, admission: Admission) -> None:
        """The request ended: its slots are free here (given back to the database when unused
        for a while: `_give_back`). Synchronous: a cancel cannot cut it short, and the edge
        calls it without a task (an `asyncio.shield` per limited request, before)."""
        for subject in admission.slots:
            if (share := self._shares.get(subject)) is not None:
                share.running -= 1

    def _share(self, subject: str) -> _Share:
        share = self._shares.get(subject)
        if share is None:
            share = self._shares[subject] = _Share()
        return share

    def _asks(self, rules: list[Rule], shares: list[_Share]) -> list[Ask]:
        """What this request needs from the database; raises RateLimited when this front
        already knows a limit refuses it."""
        now, mono, w = self.clock(), time.monotonic(), self.windows
        asks = []
        for rule, share in zip(rules, shares, strict=True):
            who, requests, slot_limit, day_limit = rule.subject, 0, None, None
            share.used_at = mono  # in use: not forgotten while it waits for the database
            if (rpm := rule.requests_per_minute) is not None:
                share.roll(store.window_start(now, w.minute_s))
                if share.allowance <= 0:
                    if share.spent == rpm:
                        raise store.refused_requests(who, rpm, store.until_next(now, w.minute_s))
                    requests = share.chunk_for(rpm)
            if (tpd := rule.tokens_per_day) is not None:
                if (share.day != store.window_start(now, w.day_s)
                        or mono - share.day_read_at > _DAY_FRESH_S):
                    day_limit = tpd
                elif share.day_used >= tpd:
                    raise store.refused_tokens(who, share.day_used, tpd,
                                               store.until_next(now, w.day_s))
            if (most := rule.max_concurrent) is not None:
                share.max_concurrent = most
                if share.running >= most:
                    raise store.refused_slots(who, share.running, most)
                # Slots taken under another limit: the database checks what all fronts hold
                # against this one before this front admits from its own again.
                if share.running >= len(share.slots) or share.slots_limit != most:
                    slot_limit = most
            if requests or slot_limit is not None or day_limit is not None:
                asks.append(Ask(who, requests, rpm or 0, 1 if requests else 0, slot_limit,
                                day_limit, share.pending + share.flushing))
        return asks

    async def _reserve(self, asks: list[Ask]) -> None:
        """One transaction for `asks` (the caller holds the lock); its grants join the shares."""
        now = self.clock()
        try:
            grants = await asyncio.to_thread(store.reserve, self.db, asks, now=now,
                                             front_id=self.front_id, windows=self.windows)
        except store.Refused as refused:
            if refused.kind == store.MINUTE:  # the counter is at the limit: none left
                share = self._shares[refused.subject]
                ask = next(a for a in asks if a.subject == refused.subject)
                share.roll(store.window_start(now, self.windows.minute_s))
                share.spent = ask.requests_limit
            raise refused.error from None
        for ask in asks:
            self._apply(self._shares[ask.subject], ask, grants[ask.subject], now)

    def _apply(self, share: _Share, ask: Ask, grant: Grant, now: float) -> None:
        mono, w = time.monotonic(), self.windows
        if ask.requests:
            minute = store.window_start(now, w.minute_s)
            if minute >= share.minute:  # else: a reservation for a minute already over
                share.roll(minute)
                share.allowance += grant.requests
                share.counted = grant.counted
                if grant.counted >= ask.requests_limit:
                    share.spent = ask.requests_limit
            # Reservations coming fast: take more at a time; coming slowly: fewer.
            since = mono - share.reserved_at
            if since < 1.0:
                share.chunk = min(_CHUNK_MAX, share.chunk * 2)
            elif since > 4.0:
                share.chunk = max(1, share.chunk // 2)
            share.reserved_at = mono
        if grant.slot is not None:
            share.slots.append(grant.slot)
            share.slots_limit = ask.slot_limit
        if ask.day_limit is not None:
            share.day, share.day_tokens = store.window_start(now, w.day_s), grant.day_tokens
            share.day_read_at = mono

    def _take(self, rules: list[Rule], shares: list[_Share]) -> Admission:
        """Counts the request against its shares (all covered: `_asks` found nothing to ask)."""
        now, w = self.clock(), self.windows
        left: list[tuple[int, int, float]] = []  # (limit, remaining, reset) of each counted
        slots = []
        for rule, share in zip(rules, shares, strict=True):
            if (rpm := rule.requests_per_minute) is not None:
                share.allowance -= 1
                left.append((rpm, max(0, rpm - share.counted + share.allowance),
                             store.until_next(now, w.minute_s)))
                if (share.allowance < share.chunk_for(rpm) // 4 and share.spent != rpm
                        and not share.refilling):
                    self._refill_ahead(rule.subject, share, rpm)
            if (tpd := rule.tokens_per_day) is not None:
                left.append((tpd, max(0, tpd - share.day_used), store.until_next(now, w.day_s)))
            if rule.max_concurrent is not None:
                share.running += 1
                share.peak = max(share.peak, share.running)
                slots.append(rule.subject)
        if not left:
            return Admission(tuple(slots))
        limit, remaining, reset = min(left, key=lambda item: (item[1], item[2]))
        return Admission(tuple(slots), limit, remaining, reset)

    def _refill_ahead(self, subject: str, share: _Share, rpm: int) -> None:
        """Reserves the next chunk in the background, before this one runs out."""
        share.refilling = True

        async def refill() -> None:
            try:
                async with self._lock:
                    now = self.clock()
                    share.roll(store.window_start(now, self.windows.minute_s))
                    if share.allowance < share.chunk_for(rpm) // 4 and share.spent != rpm:
                        await self._reserve([Ask(subject, share.chunk_for(rpm), rpm)])
            except RateLimited:
                pass
            except Exception:  # a database hiccup: the next request reserves for itself
                log.exception("limits: reserving ahead failed")
            finally:
                share.refilling = False

        task = asyncio.create_task(refill(), name="limits-refill")
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

    def on_record(self, record: RequestRecord) -> None:
        """A request log sink: no I/O here, the tokens wait for `flush`."""
        spent = record.prompt_tokens + record.completion_tokens
        if spent <= 0 or not self._table:
            return
        principal = Principal(record.user, False, frozenset(), "token", record.token_id,
                              group=self._groups.get(record.user or ""))
        for rule in self.rules_for(principal):
            if rule.tokens_per_day is not None:
                self._share(rule.subject).pending += spent

    async def flush(self) -> None:
        """Adds the tokens of finished requests to the shared counters, and reads back the
        day's counts of the subjects in use here."""
        mono = time.monotonic()
        counts = {}
        for subject, share in self._shares.items():
            if share.pending:
                counts[subject], share.flushing, share.pending = share.pending, share.pending, 0
        read = [subject for subject, share in self._shares.items()
                if share.day >= 0 and mono - share.used_at < _IDLE_S]
        if not counts and not read:
            return
        now = self.clock()
        try:
            found = await asyncio.to_thread(store.add_tokens, self.db, counts, now,
                                            self.windows, read=read)
        except BaseException:
            for subject in counts:  # not added: the next flush tries again
                share = self._shares[subject]
                share.pending, share.flushing = share.pending + share.flushing, 0
            raise
        day = store.window_start(now, self.windows.day_s)
        for subject, tokens in found.items():
            if (read_back := self._shares.get(subject)) is not None:
                read_back.day, read_back.day_tokens = day, tokens
                read_back.day_read_at, read_back.flushing = mono, 0

    async def _give_back(self) -> None:
        """Gives back the slots no request used since the last time (all those not in use when
        their limit changed since they were taken)."""
        for share in self._shares.values():
            changed = share.slots_limit != share.max_concurrent
            keep = share.running if changed else max(share.running, share.peak)
            share.peak = share.running
            while len(share.slots) > keep:
                self._unreleased.append(share.slots.pop())
        if self._unreleased:
            ids, self._unreleased = self._unreleased, []
            try:
                await asyncio.to_thread(store.release, self.db, ids)
            except BaseException:
                self._unreleased += ids
                raise

    def _forget_idle(self) -> None:
        mono = time.monotonic()
        for subject in [s for s, share in self._shares.items()
                        if share.idle and mono - share.used_at > _IDLE_S]:
            del self._shares[subject]

    # ---- background work -------------------------------------------------------------------

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="limits")

    async def stop(self) -> None:
        for task in [self._task, *self._refills]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        with contextlib.suppress(Exception):
            await self.flush()
        for share in self._shares.values():  # a clean stop frees its slots at once
            self._unreleased += share.slots
            share.slots = []
        with contextlib.suppress(Exception):
            await self._give_back()

    async def _loop(self) -> None:
        last_refresh = last_keep = last_prune = time.monotonic()
        while True:
            await asyncio.sleep(_FLUSH_S)
            now = time.monotonic()
            try:
                await self.flush()
                await self._give_back()
                if now - last_refresh >= self.refresh_s:
                    last_refresh = now
                    await self.refresh()
                held = any(share.slots for share in self._shares.values())
                if held and now - last_keep >= self.windows.slot_ttl_s / 3:
                    last_keep = now
                    await asyncio.to_thread(store.keep_slots, self.db, self.front_id,
                                            self.clock() + self.windows.slot_ttl_s)
                if now - last_prune >= _PRUNE_S:
                    last_prune = now
                    self._forget_idle()
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
