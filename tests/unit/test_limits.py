"""Quotas and rate limits (front/identity/limits_store.py, limits.py): the window math, the
counters on a real SQLite file (two limiters, each with its engine, on one file stand for two
fronts), and which limits a caller is held to."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from modelyard import db
from modelyard.errors import InvalidRequest, RateLimited
from modelyard.front.identity import limits_store as store
from modelyard.front.identity.limits import Limiter
from modelyard.front.identity.limits_store import Rule, Windows
from modelyard.front.identity.principal import Principal
from modelyard.front.ops.request_log import RequestRecord

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

T0 = 1_800_000_000.0  # a minute boundary (divisible by 60) and a UTC day's 00:00 + 16 h


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'modelyard.db'}"


@pytest.fixture
def engine(url: str) -> sa.Engine:
    return db.connect(url)


def front(url: str) -> Limiter:
    """One front's limiter, on its own engine."""
    return Limiter(db.connect(url), 2.0)


async def admit(limiter: Limiter, *rules: Rule, now: float = T0) -> store.Admission:
    limiter.clock = lambda: now
    return await limiter.admit(list(rules))


def test_window_math() -> None:
    assert T0 % 60 == 0
    assert store.window_start(T0 + 59.9, 60) == T0
    assert store.window_start(T0 + 60, 60) == T0 + 60
    assert store.until_next(T0 + 15, 60) == pytest.approx(45)
    assert store.until_next(T0, 60) == pytest.approx(60)
    day = store.window_start(T0, 86400)
    assert day % 86400 == 0 and 0 <= T0 - day < 86400  # UTC days
    assert store.until_next(T0, 86400) == pytest.approx(day + 86400 - T0)


async def test_requests_per_minute_refuse_then_recover_in_the_next_window(url: str) -> None:
    limiter, rule = front(url), Rule("token:abc", requests_per_minute=2)
    first = await admit(limiter, rule, now=T0 + 10)
    assert (first.limit, first.remaining) == (2, 1)
    assert (await admit(limiter, rule, now=T0 + 20)).remaining == 0
    with pytest.raises(RateLimited) as refused:
        await admit(limiter, rule, now=T0 + 45)
    err = refused.value
    assert err.status == 429 and err.code == "rate_limited"
    assert err.headers() == {"Retry-After": "15", "X-RateLimit-Limit": "2",
                             "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "15"}
    assert (await admit(limiter, rule, now=T0 + 60)).remaining == 1  # the next minute


async def test_a_refusal_counts_nothing_against_the_other_limits(
        url: str, engine: sa.Engine) -> None:  # fmt: skip
    limiter = front(url)
    wide = Rule("group:g", requests_per_minute=10)
    narrow = Rule("user:u", requests_per_minute=1)
    await admit(limiter, wide, narrow)
    for _ in range(3):
        with pytest.raises(RateLimited):
            await admit(limiter, wide, narrow)
    usage = store.usage(engine, ["group:g", "user:u"], T0)
    assert usage["group:g"]["requests_this_minute"] == 1  # the refused ones rolled back
    assert usage["user:u"]["requests_this_minute"] == 1


async def test_tokens_per_day_refuse_once_the_quota_is_used(url: str, engine: sa.Engine) -> None:
    limiter, rule = front(url), Rule("user:u", tokens_per_day=100)
    assert (await admit(limiter, rule)).remaining == 100
    # Another front adds tokens; this one reads the day's count back with its next flush.
    store.add_tokens(engine, {"user:u": 60}, T0)
    await limiter.flush()
    assert (await admit(limiter, rule)).remaining == 40
    store.add_tokens(engine, {"user:u": 45}, T0)  # the request that crosses it finished
    await limiter.flush()
    with pytest.raises(RateLimited) as refused:
        await admit(limiter, rule)
    assert refused.value.limit == 100 and refused.value.remaining == 0
    assert refused.value.retry_after_s == pytest.approx(store.until_next(T0, 86400))
    await admit(limiter, rule, now=store.window_start(T0, 86400) + 86400)  # a new day


async def test_concurrency_slots_are_shared_released_and_expire(url: str) -> None:
    front_a, front_b = front(url), front(url)  # two fronts, one database
    rule = Rule("token:t", max_concurrent=2)
    one = await admit(front_a, rule)
    await admit(front_b, rule)
    with pytest.raises(RateLimited):
        await admit(front_a, rule)
    front_a.release(one)
    await admit(front_a, rule)
    with pytest.raises(RateLimited):
        await admit(front_b, rule)
    # Front b dies: its slot is not kept alive, and frees after the slot TTL.
    store.keep_slots(front_a.db, front_a.front_id, T0 + 500)
    await admit(front(url), rule, now=T0 + Windows().slot_ttl_s + 1)


async def test_requests_per_minute_hold_across_two_fronts(url: str) -> None:
    fronts = [front(url), front(url)]
    rule = Rule("user:u", requests_per_minute=3)
    for i in range(3):
        await admit(fronts[i % 2], rule)
    for limiter in fronts:
        with pytest.raises(RateLimited):
            await admit(limiter, rule)


def test_limits_table_validation_and_edits(engine: sa.Engine) -> None:
    with pytest.raises(InvalidRequest):
        store.set_limit(engine, "users:x", requests_per_minute=1, tokens_per_day=None,
                        max_concurrent=None, by="admin")
    with pytest.raises(InvalidRequest):
        store.set_limit(engine, "user:x", requests_per_minute=-1, tokens_per_day=None,
                        max_concurrent=None, by="admin")
    store.set_limit(engine, "user:x", requests_per_minute=1, tokens_per_day=None,
                    max_concurrent=None, by="admin")
    store.set_limit(engine, "user:x", requests_per_minute=5, tokens_per_day=7,
                    max_concurrent=None, by="root")
    [row] = store.list_limits(engine)
    assert (row.requests_per_minute, row.tokens_per_day, row.updated_by) == (5, 7, "root")
    store.remove_limit(engine, "user:x")
    assert store.list_limits(engine) == []
    with pytest.raises(store.LimitNotFound):
        store.remove_limit(engine, "user:x")


async def test_prune_drops_old_windows_only(url: str, engine: sa.Engine) -> None:
    limiter, rule = front(url), Rule("user:u", requests_per_minute=5)
    await admit(limiter, rule, now=T0)
    await admit(limiter, rule, now=T0 + 120)
    store.prune(engine, T0 + 130)
    with engine.connect() as conn:
        starts = [r.window_start for r in conn.execute(sa.select(db.rate_counters))]
    assert starts == [T0 + 120]


def _set(engine: sa.Engine, subject: str, rpm: int | None = None, tpd: int | None = None,
         conc: int | None = None) -> None:
    store.set_limit(engine, subject, requests_per_minute=rpm, tokens_per_day=tpd,
                    max_concurrent=conc, by=None)


async def test_which_limits_a_caller_is_held_to(engine: sa.Engine) -> None:
    limiter = Limiter(engine, 2.0)
    alice = Principal("alice", False, frozenset({"inference"}), "token", "t1", group="research")
    assert limiter.rules_for(alice) == []  # nothing set: nothing to check
    _set(engine, "default", rpm=10, tpd=1000)
    _set(engine, "user:alice", rpm=20)
    _set(engine, "token:t1", conc=1)
    _set(engine, "group:research", tpd=5000)
    await limiter.refresh()
    assert limiter.rules_for(alice) == [
        Rule("token:t1", max_concurrent=1),
        Rule("user:alice", requests_per_minute=20, tokens_per_day=1000),  # default's tpd
        Rule("group:research", tokens_per_day=5000),
    ]
    assert limiter.rules_for(None) == [Rule("anonymous", 10, 1000)]
    # Tokens of a finished request count for every subject with a tokens-per-day limit.
    limiter.on_record(RequestRecord(None, T0, "alice", "t1", "openai", "/v1/chat/completions",
                                    "m", "200", 30, 0, 12, 0.1, 0.2, 0.0, False))
    await limiter.flush()
    usage = store.usage(engine, ["user:alice", "group:research", "token:t1"], limiter.clock())
    assert usage["user:alice"]["tokens_today"] == 42
    assert usage["group:research"]["tokens_today"] == 42
    assert usage["token:t1"]["tokens_today"] == 0  # no tokens-per-day limit of its own


async def test_max_num_ctx_is_the_tightest_that_applies_and_no_counter(
    engine: sa.Engine
) -> None:
    limiter = Limiter(engine, 2.0)
    alice = Principal("alice", False, frozenset({"inference"}), "token", "t1", group="research")
    bob = Principal("bob", False, frozenset({"inference"}), "token", "t2")
    assert limiter.max_num_ctx(alice) is None  # nothing set: no limit
    store.set_limit(engine, "default", requests_per_minute=None, tokens_per_day=None,
                    max_concurrent=None, by=None, max_num_ctx=8192)
    store.set_limit(engine, "group:research", requests_per_minute=None, tokens_per_day=None,
                    max_concurrent=None, by=None, max_num_ctx=32768)
    await limiter.refresh()
    assert limiter.max_num_ctx(alice) == 8192  # default's, tighter than her group's
    assert limiter.max_num_ctx(None) == 8192  # anonymous callers: default's
    store.set_limit(engine, "user:alice", requests_per_minute=None, tokens_per_day=None,
                    max_concurrent=None, by=None, max_num_ctx=65536)
    store.set_limit(engine, "token:t2", requests_per_minute=None, tokens_per_day=None,
                    max_concurrent=None, by=None, max_num_ctx=0)
    await limiter.refresh()
    assert limiter.max_num_ctx(alice) == 32768  # her own replaces default; the group's holds
    assert limiter.max_num_ctx(bob) == 0
    assert limiter.rules_for(alice) == []  # not a counted limit: no database work per request
    with pytest.raises(InvalidRequest):
        store.set_limit(engine, "default", requests_per_minute=None, tokens_per_day=None,
                        max_concurrent=None, by=None, max_num_ctx=-1)


def test_the_cli_sets_lists_and_removes_limits_and_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from modelyard.cli.main import app
    from modelyard.front.identity import accounts

    monkeypatch.setenv("MODELYARD_HOME", str(tmp_path))
    monkeypatch.delenv("MODELYARD_CONFIG", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    engine = db.connect(f"sqlite:///{tmp_path / 'modelyard.db'}")
    accounts.add_user(engine, "ivan", "a-long-password")
    runner = CliRunner()

    def run(*args: str) -> str:
        result = runner.invoke(app, list(args))
        assert result.exit_code == 0, result.output
        return result.output

    run("limits", "set", "user:ivan", "--rpm", "30", "--concurrent", "2", "--max-num-ctx", "8192")
    [row] = store.list_limits(engine)
    assert (row.requests_per_minute, row.tokens_per_day, row.max_concurrent) == (30, None, 2)
    assert row.max_num_ctx == 8192
    listed = run("limits", "ls")
    assert "user:ivan" in listed and "0/30" in listed
    bad = runner.invoke(app, ["limits", "set", "someone", "--rpm", "1"])
    assert bad.exit_code == 1 and "subject" in bad.output
    run("limits", "rm", "user:ivan")
    assert store.list_limits(engine) == []
    run("users", "set-group", "ivan", "research")
    user = accounts.get_user(engine, "ivan")
    assert user is not None and user.group == "research"
    assert "research" in run("users", "ls")
    run("users", "set-group", "ivan")
    user = accounts.get_user(engine, "ivan")
    assert user is not None and user.group is None


def test_the_principal_carries_the_users_group(engine: sa.Engine) -> None:
    from modelyard.front.identity import accounts, tokens
    from modelyard.front.identity.auth import login_principal, token_principal

    user = accounts.add_user(engine, "judy", "a-long-password")
    _, secret = tokens.create_token(engine, "judy", "t", ["inference"])
    assert login_principal(user).group is None
    accounts.set_group(engine, "judy", "research")
    user = accounts.get_user(engine, "judy")
    assert user is not None and login_principal(user).group == "research"
    found = tokens.find_token(engine, secret)
    assert found is not None and token_principal(found).group == "research"
    with pytest.raises(InvalidRequest):
        accounts.set_group(engine, "judy", "no spaces")
    with pytest.raises(accounts.UserNotFound):
        accounts.set_group(engine, "nobody", "g")
