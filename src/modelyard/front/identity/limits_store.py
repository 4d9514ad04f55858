"""Quotas and rate limits in the database: the `limits` table and the counters every front shares.

The database is the one place every front sharing it agrees on; a front goes there ahead of
need, not once per request (front/identity/limits.py keeps each subject's share in memory):
- requests per minute: a front reserves a chunk of the minute's requests in one transaction
  (`reserve`: the counter read under a lock, then raised by what is left, up to the chunk), so
  the counter never passes the limit, whatever the number of fronts;
- concurrency: a front takes slots (a row each, `concurrency_slots`) under a per-subject lock row
  (an UPDATE of it holds SQLite's write lock or PostgreSQL's row lock until commit, so two fronts
  cannot both take the last slot), holds them while its requests run, and gives back the ones
  it no longer uses (`release`);
- tokens per day: finished requests' tokens are added in batches (`add_tokens`), which reads
  the day's counters back for the fronts' checks.
A refusal rolls the whole transaction back: a request refused by one limit takes nothing of
another.

Calls are blocking; the front runs them with `asyncio.to_thread`, the CLI directly.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from modelyard import db
from modelyard.errors import InvalidRequest, ModelyardError, RateLimited

DEFAULT = "default"
MINUTE = "minute"
DAY = "day"
SLOTS = "slots"  # the lock row of a subject's concurrency slots (window_start 0)
_SUBJECT = re.compile(r"^(token:[A-Za-z0-9_-]{1,32}|(user|group):[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
                      r"|default)$")
FIELDS = ("requests_per_minute", "tokens_per_day", "max_concurrent")  # the counted ones


class LimitNotFound(ModelyardError):
    status = 404
    code = "limit_not_found"

    def __init__(self, subject: str) -> None:
        super().__init__(f"no limit for {subject!r}; GET /admin/limits lists them",
                         param="subject")


@dataclass(frozen=True)
class Limit:
    subject: str
    requests_per_minute: int | None = None
    tokens_per_day: int | None = None
    max_concurrent: int | None = None
    updated_at: float = 0.0
    updated_by: str | None = None
    # Not counted: the largest Ollama `num_ctx` beyond a model's served context (limits.py).
    max_num_ctx: int | None = None

    def public(self) -> dict[str, Any]:
        return {"subject": self.subject, "requests_per_minute": self.requests_per_minute,
                "tokens_per_day": self.tokens_per_day, "max_concurrent": self.max_concurrent,
                "max_num_ctx": self.max_num_ctx, "updated_at": self.updated_at,
                "updated_by": self.updated_by}


@dataclass(frozen=True)
class Rule:
    """What one request is held to for one counter subject (`token:…`, `user:…`, `group:…`,
    `anonymous`); None: no limit on that field."""

    subject: str
    requests_per_minute: int | None = None
    tokens_per_day: int | None = None
    max_concurrent: int | None = None

    @property
    def empty(self) -> bool:
        return (self.requests_per_minute is None and self.tokens_per_day is None
                and self.max_concurrent is None)


@dataclass(frozen=True)
class Windows:
    """Window lengths (tests shorten nothing: they move the clock instead)."""

    minute_s: float = 60.0
    day_s: float = 86400.0
    slot_ttl_s: float = 60.0  # a dead front's slots free within this


def window_start(now: float, length_s: float) -> int:
    """The start (epoch seconds) of the fixed window holding `now`; days are UTC days."""
    return int(now // length_s * length_s)


def until_next(now: float, length_s: float) -> float:
    """Seconds from `now` until the window holding it ends."""
    return window_start(now, length_s) + length_s - now


@dataclass(frozen=True)
class Admission:
    """A request let through: the subjects whose concurrency slot it holds on this front
    (released when it ends: `Limiter.release`) and the tightest limit it has left, for the
    X-RateLimit-* headers of its answer (None: only a concurrency limit)."""

    slots: tuple[str, ...]
    limit: int | None = None
    remaining: int = 0
    reset_s: float = 0.0


def check_subject(subject: str) -> str:
    if not _SUBJECT.match(subject):
        raise InvalidRequest(
            "a limit's subject is `token:<id>`, `user:<name>`, `group:<name>` or `default`",
            param="subject")
    return subject


# ---- the limits table ----------------------------------------------------------------------


def _limit(row: Any) -> Limit:
    return Limit(row.subject, row.requests_per_minute, row.tokens_per_day, row.max_concurrent,
                 row.updated_at, row.updated_by, row.max_num_ctx)


def list_limits(engine: sa.Engine) -> list[Limit]:
    with engine.connect() as conn:
        return [_limit(r) for r in conn.execute(sa.select(db.limits)
                                                .order_by(db.limits.c.subject))]


def set_limit(engine: sa.Engine, subject: str, *, requests_per_minute: int | None,
              tokens_per_day: int | None, max_concurrent: int | None,
              by: str | None, max_num_ctx: int | None = None) -> Limit:
    """Creates or replaces the subject's limits (every field: None is no limit)."""
    check_subject(subject)
    for name, value in zip((*FIELDS, "max_num_ctx"),
                           (requests_per_minute, tokens_per_day, max_concurrent, max_num_ctx),
                           strict=True):
        if value is not None and value < 0:
            raise InvalidRequest(f"{name} is a count, 0 or more (null: no limit)", param=name)
    stamp = time.time()
    values = {"requests_per_minute": requests_per_minute, "tokens_per_day": tokens_per_day,
              "max_concurrent": max_concurrent, "max_num_ctx": max_num_ctx,
              "updated_at": stamp, "updated_by": by}
    with engine.begin() as conn:  # update, else insert: one transaction, any dialect
        done = conn.execute(db.limits.update().where(db.limits.c.subject == subject)
                            .values(**values)).rowcount
        if not done:
            conn.execute(db.limits.insert().values(subject=subject, **values))
    return Limit(subject, requests_per_minute, tokens_per_day, max_concurrent, stamp, by,
                 max_num_ctx)


def remove_limit(engine: sa.Engine, subject: str) -> None:
    with engine.begin() as conn:
        if not conn.execute(db.limits.delete().where(db.limits.c.subject == subject)).rowcount:
            raise LimitNotFound(subject)


def usage(engine: sa.Engine, subjects: Iterable[str], now: float,
          windows: Windows = Windows()) -> dict[str, dict[str, int]]:
    """What each subject's counters hold now: requests this minute, tokens today, running."""
    wanted = list(subjects)
    out = {s: {"requests_this_minute": 0, "tokens_today": 0, "concurrent": 0} for s in wanted}
    c, slots = db.rate_counters.c, db.concurrency_slots.c
    with engine.connect() as conn:
        for kind, length, key in ((MINUTE, windows.minute_s, "requests_this_minute"),
                                  (DAY, windows.day_s, "tokens_today")):
            query = sa.select(c.subject, c.count).where(
                c.subject.in_(wanted), c.kind == kind,
                c.window_start == window_start(now, length))
            for subject, count in conn.execute(query):
                out[subject][key] = int(count)
        query = (sa.select(slots.subject, sa.func.count()).where(
            slots.subject.in_(wanted), slots.expires_at > now).group_by(slots.subject))
        for subject, count in conn.execute(query):
            out[subject]["concurrent"] = int(count)
    return out


# ---- counters -------------------------------------------------------------------------------


def _insert_missing(conn: sa.Connection, subject: str, window: str, start: int) -> None:
    """The counter row, at 0, unless it is there (no failed INSERT: PostgreSQL would abort the
    transaction)."""
    values = {"subject": subject, "kind": window, "window_start": start, "count": 0}
    if conn.dialect.name == "postgresql":
        conn.execute(postgresql.insert(db.rate_counters).values(**values)
                     .on_conflict_do_nothing())
    else:
        conn.execute(sqlite.insert(db.rate_counters).values(**values).on_conflict_do_nothing())


def _where(subject: str, window: str, start: int) -> sa.ColumnElement[bool]:
    c = db.rate_counters.c
    return sa.and_(c.subject == subject, c.kind == window, c.window_start == start)


def _count(conn: sa.Connection, subject: str, window: str, start: int) -> int:
    value = conn.execute(sa.select(db.rate_counters.c.count)
                         .where(_where(subject, window, start))).scalar()
    return int(value or 0)


class Refused(Exception):
    """A request over one subject's limit (`kind`: MINUTE, DAY or SLOTS); the transaction took
    nothing. `error` is the 429 to answer."""

    def __init__(self, error: RateLimited, subject: str, kind: str) -> None:
        self.error, self.subject, self.kind = error, subject, kind


@dataclass(frozen=True)
class Ask:
    """What a front asks the shared counters for one subject, in one transaction."""

    subject: str
    requests: int = 0  # requests of this minute to reserve, as many as the limit leaves…
    requests_limit: int = 0  # …under this limit
    at_least: int = 0  # fewer left than this: refused (0: an ahead-of-need reservation)
    slot_limit: int | None = None  # take one concurrency slot under this limit
    day_limit: int | None = None  # read the day's tokens; refused when they reach this…
    day_pending: int = 0  # …with the front's tokens not added yet


@dataclass(frozen=True)
class Grant:
    """What the transaction gave one subject."""

    requests: int = 0  # reserved for this front
    counted: int = 0  # the minute's counter after it (every front's reservations)
    slot: str | None = None
    day_tokens: int = 0  # the day's counter, when asked


def refused_requests(who: str, limit: int, reset: float) -> RateLimited:
    return RateLimited(f"{who} sent its {limit} requests of this minute; try again in "
                       f"{max(1, round(reset))} s", retry_after_s=reset, limit=limit,
                       remaining=0, reset_s=reset)


def refused_tokens(who: str, used: int, limit: int, reset: float) -> RateLimited:
    return RateLimited(f"{who} used {used} of its {limit} tokens per day; it gets more in "
                       f"{round(reset)} s", retry_after_s=reset, limit=limit, remaining=0,
                       reset_s=reset)


def refused_slots(who: str, running: int, limit: int) -> RateLimited:
    return RateLimited(f"{who} has {running} requests running, its limit of concurrent "
                       "requests; try again when one ends", retry_after_s=1.0, limit=limit,
                       remaining=0, reset_s=1.0)


def reserve(engine: sa.Engine, asks: list[Ask], *, now: float, front_id: str,
            windows: Windows = Windows()) -> dict[str, Grant]:
    """Reserves requests, takes slots and reads day counters for a front, all in one
    transaction; raises Refused and takes nothing when an ask's `at_least`, slot or day cannot
    be had (a request refused by one limit spends nothing of another)."""
    with engine.begin() as conn:  # Refused rolls it back
        return _reserve(conn, sorted(asks, key=lambda a: a.subject), now, front_id, windows)


def _reserve(conn: sa.Connection, asks: list[Ask], now: float, front_id: str,
             w: Windows) -> dict[str, Grant]:
    minute = window_start(now, w.minute_s)
    # The writes' rows first: SQLite then holds its write lock from the transaction's first
    # statement, and never fails upgrading a read lock while another front writes.
    for ask in asks:
        if ask.requests:
            _insert_missing(conn, ask.subject, MINUTE, minute)
        if ask.slot_limit is not None:
            _insert_missing(conn, ask.subject, SLOTS, 0)
    c = db.rate_counters.c
    grants = {}
    for ask in asks:
        who = ask.subject
        taken = counted = 0
        if ask.requests:
            # Read under the lock (PostgreSQL: FOR UPDATE; SQLite: the write lock held), then
            # take what is left: two fronts cannot both take the last requests.
            counted = int(conn.execute(sa.select(c.count).where(_where(who, MINUTE, minute))
                                       .with_for_update()).scalar() or 0)
            taken = max(0, min(ask.requests, ask.requests_limit - counted))
            if taken < ask.at_least:
                raise Refused(refused_requests(who, ask.requests_limit,
                                               until_next(now, w.minute_s)), who, MINUTE)
            if taken:
                counted += taken
                conn.execute(db.rate_counters.update().where(_where(who, MINUTE, minute))
                             .values(count=c.count + taken))
        slot = None
        if ask.slot_limit is not None:
            slot = _take_slot(conn, who, ask.slot_limit, now, front_id, w)
        day = 0
        if ask.day_limit is not None:
            day = _count(conn, who, DAY, window_start(now, w.day_s))
            if day + ask.day_pending >= ask.day_limit:
                raise Refused(refused_tokens(who, day + ask.day_pending, ask.day_limit,
                                             until_next(now, w.day_s)), who, DAY)
        grants[who] = Grant(taken, counted, slot, day)
    return grants


def _take_slot(conn: sa.Connection, who: str, limit: int, now: float, front_id: str,
               w: Windows) -> str:
    s, c = db.concurrency_slots.c, db.rate_counters.c
    # Lock the subject's slots until commit (SQLite: the write lock; PostgreSQL: the row's).
    conn.execute(db.rate_counters.update().where(_where(who, SLOTS, 0)).values(count=c.count))
    conn.execute(db.concurrency_slots.delete().where(s.subject == who, s.expires_at <= now))
    held = conn.execute(sa.select(sa.func.count()).select_from(db.concurrency_slots)
                        .where(s.subject == who)).scalar() or 0
    if held >= limit:
        raise Refused(refused_slots(who, held, limit), who, SLOTS)
    slot_id = secrets.token_hex(8)
    conn.execute(db.concurrency_slots.insert().values(
        id=slot_id, subject=who, front_id=front_id, expires_at=now + w.slot_ttl_s))
    return slot_id


def release(engine: sa.Engine, slots: Iterable[str]) -> None:
    ids = list(slots)
    if ids:
        with engine.begin() as conn:
            conn.execute(db.concurrency_slots.delete().where(db.concurrency_slots.c.id.in_(ids)))


def keep_slots(engine: sa.Engine, front_id: str, expires_at: float) -> None:
    """Pushes this front's running slots' expiry forward (it is alive)."""
    s = db.concurrency_slots.c
    with engine.begin() as conn:
        conn.execute(db.concurrency_slots.update().where(s.front_id == front_id)
                     .values(expires_at=expires_at))


def add_tokens(engine: sa.Engine, counts: dict[str, int], now: float,
               windows: Windows = Windows(), *, read: Iterable[str] = ()) -> dict[str, int]:
    """Adds each subject's finished requests' tokens to today's counter (atomic increments, so
    fronts adding at once lose nothing), and reads back today's counters of those subjects and
    of `read`'s, every front's tokens included."""
    day = window_start(now, windows.day_s)
    c = db.rate_counters.c
    with engine.begin() as conn:
        for subject, n in sorted(counts.items()):
            _insert_missing(conn, subject, DAY, day)
            conn.execute(db.rate_counters.update().where(_where(subject, DAY, day))
                         .values(count=c.count + n))
        wanted = sorted({*counts, *read})
        found = {} if not wanted else dict(conn.execute(
            sa.select(c.subject, c.count).where(c.subject.in_(wanted), c.kind == DAY,
                                                c.window_start == day)).all())
    return {subject: int(found.get(subject, 0)) for subject in wanted}


def prune(engine: sa.Engine, now: float, windows: Windows = Windows()) -> None:
    """Drops counters of windows long over, and slots that expired (a front that died)."""
    c, s = db.rate_counters.c, db.concurrency_slots.c
    with engine.begin() as conn:
        conn.execute(db.rate_counters.delete().where(
            c.kind == MINUTE, c.window_start < window_start(now, windows.minute_s)))
        conn.execute(db.rate_counters.delete().where(
            c.kind == DAY, c.window_start < window_start(now, windows.day_s)))
        conn.execute(db.concurrency_slots.delete().where(s.expires_at <= now))
