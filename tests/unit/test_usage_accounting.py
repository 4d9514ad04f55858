"""Usage accounting without a server: the hourly aggregation, the incrementing upsert on a real
SQLite file (two recorders = two fronts on one database), answers that add what is not flushed
yet without counting it twice, the bounded owner label, and the prompt tokens of a backend's
usage."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from modelyard import db, metrics
from modelyard.cli.usage import since_start
from modelyard.errors import Forbidden, InvalidRequest
from modelyard.front.api.usage import parse_group_by, parse_time, to_csv
from modelyard.front.ops import usage_store
from modelyard.front.ops.request_log import RequestRecord
from modelyard.front.ops.usage import OwnerLabels, UsageRecorder, add_record, hour_of
from modelyard.front.ops.usage_store import Bucket, Key, Query

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z, an hour's start
assert T0 % 3600 == 0


def rec(user: str | None = "ann", *, at: float = T0 + 10, model: str = "m", api: str = "openai",
        status: str = "200", prompt: int = 10, cached: int = 4, completion: int = 5,
        ttft: float | None = 0.5, duration: float = 2.0, token: str | None = "tok1",
        swapped: bool = False) -> RequestRecord:
    return RequestRecord(
        request_id="r", started_at=at, user=user, token_id=token, api=api, path="/x",
        model=model, status=status, prompt_tokens=prompt, cached_tokens=cached,
        completion_tokens=completion, ttft_s=ttft, duration_s=duration, queue_wait_s=0.25,
        swapped=swapped)


def test_records_sum_per_hour_owner_token_model_api() -> None:
    buckets: dict[Key, Bucket] = {}
    add_record(buckets, rec())
    add_record(buckets, rec(at=T0 + 3599, status="queue_full", ttft=None, swapped=True))
    add_record(buckets, rec(at=T0 + 3600))  # the next hour
    add_record(buckets, rec(None, token=None, model=""))  # anonymous, never routed: counted
    first = buckets[Key(int(T0), "ann", "tok1", "m", "openai")]
    assert (first.requests, first.errors, first.prompt_tokens, first.cached_tokens,
            first.completion_tokens) == (2, 1, 20, 8, 10)
    assert (first.ttft_sum_s, first.ttft_count, first.duration_sum_s, first.swaps) == \
        (0.5, 1, 4.0, 1)
    assert first.queue_wait_sum_s == 0.5
    assert buckets[Key(int(T0) + 3600, "ann", "tok1", "m", "openai")].requests == 1
    assert buckets[Key(int(T0), "", "", "", "openai")].requests == 1
    assert hour_of(T0 + 3599.9) == T0


def test_owner_label_is_bounded() -> None:
    labels = OwnerLabels(["boss"], top=2)
    assert [labels.label(o) for o in ("a", "b", "c", "boss", "a", None, "")] == \
        ["a", "b", "other", "boss", "a", "anonymous", "anonymous"]
    assert OwnerLabels([], top=0).label("a") == "other"


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        # llama-server's final event without usage: only timings, 6 prompt tokens reused
        ({"choices": [], "timings": {"cache_n": 6, "prompt_n": 3, "predicted_n": 16}},
         (9, 16, 6)),
        # usage present: it already counts every prompt token; cache_n is not added again
        ({"usage": {"completion_tokens": 2, "prompt_tokens": 9,
                    "prompt_tokens_details": {"cached_tokens": 6}},
          "timings": {"cache_n": 6, "prompt_n": 3, "predicted_n": 2}}, (9, 2, 6)),
        # llama-server's native completion (/infill)
        ({"stop": True, "tokens_evaluated": 9, "tokens_predicted": 2}, (9, 2, 0)),
        ({"choices": []}, None),
    ],
)
def test_prompt_tokens_of_a_backends_usage_include_the_cached(
        event: dict[str, object], expected: tuple[int, int, int] | None) -> None:
    assert metrics.usage_of(event) == expected


def test_parse_time_and_group_by() -> None:
    assert parse_time("start", "1800000000") == T0
    assert parse_time("start", "2027-01-15T08:00:00Z") == T0
    assert parse_time("start", "2027-01-15T08:00:00") == T0  # no zone: UTC
    assert parse_time("start", "2027-01-15T09:00:00+01:00") == T0
    for bad in ("yesterday", "nan", "-5", "1e99"):
        with pytest.raises(InvalidRequest) as info:
            parse_time("start", bad)
        assert info.value.param == "start"
    assert parse_group_by("model,day") == ("day", "model")  # the period first
    assert parse_group_by(None) == ("user", "model")
    assert parse_group_by("") == ()
    for bad in ("user,week", "hour,day"):
        with pytest.raises(InvalidRequest):
            parse_group_by(bad)
    assert not issubclass(Forbidden, InvalidRequest)


def _db(path: Path) -> sa.Engine:
    return db.connect(f"sqlite:///{path}")


WIDE = Query(T0 - 86400, T0 + 86400, group_by=("user", "model"))


async def test_two_fronts_add_up_and_unflushed_counts_show_once(tmp_path: Path) -> None:
    database = _db(tmp_path / "u.db")
    try:
        front_a = UsageRecorder(database, 3600)
        front_b = UsageRecorder(database, 3600)
        front_a.record(rec())
        front_b.record(rec(completion=7))
        # Not flushed: front A sees its own request at once, not B's (B has not written it).
        [row] = await front_a.query(WIDE)
        assert (row["owner"], row["requests"], row["completion_tokens"]) == ("ann", 1, 5)
        assert await front_a.flush() == 1
        assert await front_b.flush() == 1
        [row] = await front_a.query(WIDE)
        assert (row["requests"], row["prompt_tokens"], row["cached_tokens"],
                row["completion_tokens"], row["total_tokens"]) == (2, 20, 8, 12, 32)
        assert row["avg_ttft_s"] == 0.5 and row["avg_duration_s"] == 2.0
        # Flushed and then more: the flushed part from the database, the rest from memory.
        front_a.record(rec(prompt=1, cached=0, completion=1))
        [row] = await front_a.query(WIDE)
        assert (row["requests"], row["prompt_tokens"]) == (3, 21)
        await front_a.stop()  # the last flush
        await front_b.stop()
        with database.connect() as conn:
            stored = conn.execute(sa.select(db.usage_hourly)).mappings().all()
        assert [(r["requests"], r["prompt_tokens"]) for r in stored] == [(3, 21)]
    finally:
        database.dispose()


async def test_the_periodic_flush_writes_and_a_failed_one_keeps_the_counts(
        tmp_path: Path) -> None:
    database = _db(tmp_path / "u.db")
    recorder = UsageRecorder(database, 0.05)
    try:
        await recorder.start()
        recorder.record(rec())

        def stored() -> int:
            with database.connect() as conn:
                return int(conn.execute(
                    sa.select(sa.func.coalesce(sa.func.sum(db.usage_hourly.c.requests), 0))
                ).scalar_one())

        for _ in range(200):  # awaits the flush task's write, at most ~10 s
            if stored() == 1:
                break
            await asyncio.sleep(0.05)
        assert stored() == 1 and recorder.pending == {}
        # A failed write (the table is gone) puts the batch back, merged with newer records.
        await recorder.stop()
        with database.begin() as conn:
            conn.execute(sa.text("DROP TABLE usage_hourly"))
        recorder.record(rec())
        with pytest.raises(sa.exc.OperationalError):
            await recorder.flush()
        recorder.record(rec())
        assert sum(b.requests for b in recorder.pending.values()) == 2
    finally:
        database.dispose()


async def test_filters_groups_and_csv(tmp_path: Path) -> None:
    database = _db(tmp_path / "u.db")
    try:
        recorder = UsageRecorder(database, 3600)
        recorder.record(rec("ann", model="m1"))
        recorder.record(rec("bob", model="m2", token="tok2", api="ollama"))
        recorder.record(rec("bob", model="m2", at=T0 + 86400 + 5))  # the next day
        await recorder.flush()
        recorder.record(rec("bob", model="m1", at=T0 + 20))  # in memory only
        by_day = Query(T0 - 86400, T0 + 3 * 86400, group_by=("day",))
        rows = await recorder.query(by_day)
        assert [(r["period"], r["requests"]) for r in rows] == \
            [("2027-01-15T00:00:00Z", 3), ("2027-01-16T00:00:00Z", 1)]
        bob = Query(T0 - 86400, T0 + 3 * 86400, owner="bob", model="m2",
                    group_by=("hour", "api", "token"))
        rows = await recorder.query(bob)
        assert [(r["period"], r["api"], r["token_id"]) for r in rows] == [
            ("2027-01-15T08:00:00Z", "ollama", "tok2"), ("2027-01-16T08:00:00Z", "openai", "tok1")]
        # The period selects hours that overlap it: this one ends before the next day's row.
        early = Query(T0, T0 + 60, group_by=())
        [total] = await recorder.query(early)
        assert total["requests"] == 3
        assert await recorder.query(Query(T0 + 3600, T0 + 7200, group_by=())) == []
        text = to_csv(bob, rows)
        lines = text.splitlines()
        assert lines[0].startswith("period,api,token_id,requests,errors,prompt_tokens")
        assert lines[1].startswith("2027-01-15T08:00:00Z,ollama,tok2,1,0,10,4,5,15,0.5,2.0")
        await recorder.stop()
    finally:
        database.dispose()


def test_cli_since_is_a_duration_back_or_a_time() -> None:
    assert since_start("24h", T0) == str(int(T0 - 86400))
    assert since_start("30m", T0) == str(int(T0 - 1800))
    assert since_start("2027-01-01", T0) == "2027-01-01"  # the server parses it


def test_the_sql_is_postgresql_too() -> None:
    """The upsert increments on PostgreSQL as on SQLite, and the day grouping is integer
    arithmetic there too (the SQLite runs above execute it; this checks PostgreSQL's text)."""
    pg = postgresql.dialect()
    text = str(usage_store.upsert("postgresql").compile(dialect=pg))
    assert "ON CONFLICT (hour, owner, token_id, model, api) DO UPDATE SET" in text
    assert "requests = (usage_hourly.requests + excluded.requests)" in text
    day = str(usage_store.select(Query(0, 1, owner="a", group_by=("day", "user"))).compile(
        dialect=pg))
    assert "GROUP BY" in day and "usage_hourly.hour / %(hour_1)s" in day
