"""Usage accounting: every finished inference request, summed per hour and owner in the database.

`UsageRecorder.record` is a RequestLog sink (front/ops/request_log.py): it runs on the event loop
on the request path, so it only adds the record to an in-memory bucket keyed by (hour start UTC,
owner, token, model, API). A background task flushes the buckets every `usage_flush_interval_s`
(and once more at shutdown) into `usage_hourly`, ADDING to the rows there (front/ops/
usage_store.py): several fronts on one database add up instead of overwriting each other.

Answers (`GET /v1/usage`) read the database plus what this front has not flushed yet, under the
same lock as the flush, so a request shows at once and is never counted twice.

The recorder also counts the Prometheus usage families with a bounded `owner` label
(`OwnerLabels`): named owners, then the first N others seen, then "other".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import fields

import sqlalchemy as sa

from modelyard import metrics
from modelyard.front.ops import usage_store
from modelyard.front.ops.request_log import RequestRecord
from modelyard.front.ops.usage_store import Bucket, Key, Query

log = logging.getLogger(__name__)

HOUR_S = 3600


def hour_of(wall_clock: float) -> int:
    """The start (unix seconds, UTC) of the hour `wall_clock` falls in."""
    return int(wall_clock // HOUR_S) * HOUR_S


def key_of(record: RequestRecord) -> Key:
    return Key(hour_of(record.started_at), record.user or "", record.token_id or "",
               record.model, record.api)


def add_record(buckets: dict[Key, Bucket], record: RequestRecord) -> None:
    """Add one finished request to its hour's bucket."""
    bucket = buckets.get(key := key_of(record))
    if bucket is None:
        bucket = buckets[key] = Bucket()
    bucket.requests += 1
    bucket.errors += 0 if record.ok else 1
    bucket.prompt_tokens += record.prompt_tokens
    bucket.cached_tokens += record.cached_tokens
    bucket.completion_tokens += record.completion_tokens
    if record.ttft_s is not None:
        bucket.ttft_sum_s += record.ttft_s
        bucket.ttft_count += 1
    bucket.duration_sum_s += record.duration_s
    bucket.queue_wait_sum_s += record.queue_wait_s
    bucket.swaps += 1 if record.swapped else 0


def merge(into: dict[Key, Bucket], more: dict[Key, Bucket]) -> None:
    for key, bucket in more.items():
        have = into.get(key)
        if have is None:
            into[key] = Bucket(**{f.name: getattr(bucket, f.name) for f in fields(Bucket)})
        else:
            have.add(bucket)


class OwnerLabels:
    """The `owner` label of the usage metrics, bounded: owners named in `usage_metric_owners`
    keep their name, the first `top` other owners this front sees get theirs too, everyone
    after that is "other"; anonymous callers are "anonymous"."""

    def __init__(self, named: Iterable[str], top: int) -> None:
        self.named = frozenset(named)
        self.top = top
        self.seen: set[str] = set()

    def label(self, owner: str | None) -> str:
        if not owner:
            return "anonymous"
        if owner in self.named or owner in self.seen:
            return owner
        if len(self.seen) < self.top:
            self.seen.add(owner)
            return owner
        return "other"


class UsageRecorder:
    def __init__(self, database: sa.Engine, flush_interval_s: float,
                 metric_owners: Iterable[str] = (), metric_top_owners: int = 10) -> None:
        self.db = database
        self.flush_interval_s = flush_interval_s
        self.labels = OwnerLabels(metric_owners, metric_top_owners)
        self.pending: dict[Key, Bucket] = {}
        # One flush or one answer at a time: an answer never sees a batch both in the
        # database and in memory.
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    # ---- the sink (event loop, request path: no awaits, no I/O, never raises) -------------

    def record(self, record: RequestRecord) -> None:
        add_record(self.pending, record)
        owner = self.labels.label(record.user)
        metrics.usage_counted(owner, record.model, record.prompt_tokens, record.cached_tokens,
                              record.completion_tokens)

    # ---- flushing ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-flush")

    async def stop(self) -> None:
        """Stop the periodic flush and write what is left (a clean stop loses nothing). The
        task is asked to end, not cancelled: a cancelled flush could still commit in its thread
        and then be written again."""
        self._stopping.set()
        if self._task is not None:
            await self._task
            self._task = None
        await self.flush()

    async def _run(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.flush_interval_s)
            try:
                await self.flush()
            except Exception:  # the database is away: keep counting, try again next time
                log.exception("usage flush failed; keeping the counts for the next try")

    async def flush(self) -> int:
        """Add the pending buckets to the database; returns how many rows it wrote. On a
        failure the buckets go back to `pending` (merged with what came meanwhile)."""
        async with self._lock:
            if not self.pending:
                return 0
            batch, self.pending = self.pending, {}
            try:
                await asyncio.to_thread(usage_store.add, self.db, batch)
            except BaseException:
                merge(batch, self.pending)
                self.pending = batch
                raise
            return len(batch)

    # ---- answers ----------------------------------------------------------------------------

    async def query(self, query: Query) -> list[dict[str, object]]:
        """The rows of `query`: the database's sums plus what this front has not flushed."""
        async with self._lock:
            memory = {k: b for k, b in self.pending.items() if query.matches(k)}
            # Copied on the loop: the sink keeps adding to `pending` while the thread reads.
            snapshot: dict[Key, Bucket] = {}
            merge(snapshot, memory)
            return await asyncio.to_thread(usage_store.query, self.db, query, snapshot)
