"""The `usage_hourly` table: adding a front's buckets to it, and reading sums out of it.

Blocking (SQLAlchemy Core); the recorder calls it through `asyncio.to_thread`. Adding is an
upsert that INCREMENTS (`ON CONFLICT … DO UPDATE SET n = n + excluded.n`, which SQLite ≥ 3.24
and PostgreSQL both speak), so two fronts writing the same hour add up, decided by the
database, not by either front's memory.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from modelyard import db

DAY_S = 86400
HOUR_S = 3600


class Key(NamedTuple):
    hour: int  # start of the hour, unix seconds UTC
    owner: str  # "" anonymous
    token_id: str  # "" no token (a login session, or anonymous)
    model: str  # "" never routed to a model
    api: str


@dataclass
class Bucket:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0  # every prompt token, the cached ones included
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_sum_s: float = 0.0
    ttft_count: int = 0
    duration_sum_s: float = 0.0
    queue_wait_sum_s: float = 0.0
    swaps: int = 0

    def add(self, other: Bucket) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


COUNTERS = tuple(f.name for f in fields(Bucket))

# group_by names → (the answer's field, the column or expression, the key's part in memory)
GROUPS: dict[str, tuple[str, Callable[[], Any], Callable[[Key], Any]]] = {
    "hour": ("period", lambda: db.usage_hourly.c.hour, lambda k: k.hour),
    "day": ("period", lambda: db.usage_hourly.c.hour // DAY_S * DAY_S,
            lambda k: k.hour // DAY_S * DAY_S),
    "user": ("owner", lambda: db.usage_hourly.c.owner, lambda k: k.owner),
    "model": ("model", lambda: db.usage_hourly.c.model, lambda k: k.model),
    "api": ("api", lambda: db.usage_hourly.c.api, lambda k: k.api),
    "token": ("token_id", lambda: db.usage_hourly.c.token_id, lambda k: k.token_id),
}


@dataclass(frozen=True)
class Query:
    start: float  # unix seconds: hours that end after it…
    end: float  # …and start before it
    owner: str | None = None  # None: every owner (admins only)
    model: str | None = None
    group_by: tuple[str, ...] = field(default=("user", "model"))

    def matches(self, key: Key) -> bool:
        return (key.hour + HOUR_S > self.start and key.hour < self.end
                and (self.owner is None or key.owner == self.owner)
                and (self.model is None or key.model == self.model))


def upsert(name: str) -> Any:
    """The incrementing upsert for the dialect `name` (sqlite or postgresql)."""
    table = db.usage_hourly
    if name == "postgresql":
        insert: Any = postgresql.insert(table)
    elif name == "sqlite":
        insert = sqlite.insert(table)
    else:  # pragma: no cover - modelyard speaks SQLite and PostgreSQL only
        raise RuntimeError(f"usage accounting does not support the {name} dialect")
    return insert.on_conflict_do_update(
        index_elements=[c.name for c in table.primary_key.columns],
        set_={c: table.c[c] + insert.excluded[c] for c in COUNTERS},
    )


def add(database: sa.Engine, buckets: dict[Key, Bucket]) -> None:
    """Add every bucket to its row, in one transaction (all of a flush or none of it)."""
    rows = [{**key._asdict(), **{c: getattr(b, c) for c in COUNTERS}}
            for key, b in buckets.items()]
    with database.begin() as conn:
        conn.execute(upsert(database.dialect.name), rows)


def query(database: sa.Engine, q: Query, memory: dict[Key, Bucket]) -> list[dict[str, Any]]:
    """The sums of the rows `q` selects, grouped by `q.group_by`, the database's and `memory`'s
    (what the front has not flushed yet) together; ordered by period then keys."""
    groups = [GROUPS[g] for g in q.group_by]
    totals: dict[tuple[Any, ...], Bucket] = {}
    with database.connect() as conn:
        for row in conn.execute(select(q)).mappings():
            if row["requests"] is None:  # no group_by and no rows: one row of NULL sums
                continue
            keys = tuple(_plain(row[out]) for out, _, _ in groups)
            bucket = totals[keys] = Bucket()
            for c in COUNTERS:
                setattr(bucket, c, _number(c, row[c]))
    for key, bucket in memory.items():
        if not q.matches(key):
            continue
        keys = tuple(part(key) for _, _, part in groups)
        have = totals.get(keys)
        if have is None:
            have = totals[keys] = Bucket()
        have.add(bucket)
    names = [out for out, _, _ in groups]
    return [_answer(names, keys, totals[keys]) for keys in sorted(totals)]


def select(q: Query) -> sa.Select[Any]:
    """The database's sums for `q`, grouped (the same SQL on SQLite and PostgreSQL)."""
    table = db.usage_hourly
    groups = [GROUPS[g] for g in q.group_by]
    columns = [expr().label(out) for out, expr, _ in groups]
    sums = [sa.func.sum(table.c[c]).label(c) for c in COUNTERS]
    where = [table.c.hour > q.start - HOUR_S, table.c.hour < q.end]
    if q.owner is not None:
        where.append(table.c.owner == q.owner)
    if q.model is not None:
        where.append(table.c.model == q.model)
    stmt = sa.select(*columns, *sums).where(*where)
    return stmt.group_by(*columns) if columns else stmt


def _plain(value: Any) -> Any:
    # A period comes back as int, or Decimal from PostgreSQL's arithmetic; names as str.
    return value if isinstance(value, str) else int(value)


def _number(column: str, value: Any) -> int | float:
    # PostgreSQL's SUM of a BIGINT is NUMERIC (a Decimal): back to int; the sums of seconds float
    if value is None:
        return 0
    return float(value) if column.endswith("_s") else int(value)


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _answer(names: list[str], keys: tuple[Any, ...], b: Bucket) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for name, value in zip(names, keys, strict=True):
        row[name] = iso(value) if name == "period" else value
    row.update(
        requests=b.requests,
        errors=b.errors,
        prompt_tokens=b.prompt_tokens,
        cached_tokens=b.cached_tokens,
        completion_tokens=b.completion_tokens,
        total_tokens=b.prompt_tokens + b.completion_tokens,
        avg_ttft_s=round(b.ttft_sum_s / b.ttft_count, 6) if b.ttft_count else None,
        avg_duration_s=round(b.duration_sum_s / b.requests, 6) if b.requests else None,
        avg_queue_wait_s=round(b.queue_wait_sum_s / b.requests, 6) if b.requests else None,
        swaps=b.swaps,
    )
    return row
