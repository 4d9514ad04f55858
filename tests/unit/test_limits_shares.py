"""Each front's share of the limits (front/identity/limits.py, issue 33): a limited request costs
no database work in the common case, and the limits still hold across fronts sharing one
database. Two limiters, each with its own engine, on one real SQLite file stand for two fronts;
the statements they send are counted on the engine (SQLAlchemy's own event)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from modelyard import db
from modelyard.errors import RateLimited
from modelyard.front.identity import limits_store as store
from modelyard.front.identity.limits import _CHUNK_MAX, _CHUNK_SHARE, Limiter
from modelyard.front.identity.limits_store import Admission, Rule
from modelyard.front.identity.principal import Principal
from modelyard.front.ops.request_log import RequestRecord

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

T0 = 1_800_000_000.0  # a minute boundary


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'modelyard.db'}"


def front(url: str, now: float = T0 + 1) -> Limiter:
    limiter = Limiter(db.connect(url), 2.0)
    limiter.clock = lambda: now
    return limiter


def writes_to(limiter: Limiter) -> Callable[[], int]:
    """How many writes to the counters' tables the limiter's engine sent so far."""
    seen = [0]

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        head = statement.lstrip().upper()
        if head.startswith(("INSERT", "UPDATE", "DELETE")) and (
                "RATE_COUNTERS" in head or "CONCURRENCY_SLOTS" in head):
            seen[0] += 1

    sa.event.listen(limiter.db, "before_cursor_execute", count)
    return lambda: seen[0]


def minute_count(engine: sa.Engine, subject: str, now: float = T0 + 1) -> int:
    return store.usage(engine, [subject], now)[subject]["requests_this_minute"]


async def admit_all(limiter: Limiter, rule: Rule, n: int) -> list[Admission]:
    """`n` requests at once on one front: those admitted (the others were refused)."""
    results = await asyncio.gather(*(limiter.admit([rule]) for _ in range(n)),
                                   return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, RateLimited):
            raise r
    return [r for r in results if isinstance(r, Admission)]


async def test_a_busy_limited_caller_costs_the_database_a_write_per_chunk(url: str) -> None:
    """Before: a write transaction per request (1,000 here). Now reservations of up to
    _CHUNK_MAX requests, taken ahead of need, and never more than a chunk beyond what was used."""
    limiter = front(url)
    writes = writes_to(limiter)
    rule = Rule("token:busy", requests_per_minute=10**9)
    for _ in range(1000):
        await limiter.admit([rule])
    assert writes() <= 2 * (1000 // _CHUNK_MAX + 10), writes()
    await asyncio.gather(*limiter._refills)
    reserved = minute_count(limiter.db, "token:busy")
    assert 1000 <= reserved <= 1000 + _CHUNK_MAX
    # In the steady state most requests waited for nothing: admitted from the share in memory.
    before = writes()
    admitted = [await limiter.admit([rule]) for _ in range(_CHUNK_MAX // 2)]
    assert writes() - before <= 2 and all(a.remaining > 0 for a in admitted)
    await limiter.stop()


async def test_a_small_limit_is_reserved_one_request_at_a_time(url: str) -> None:
    """Under _CHUNK_SHARE requests a minute nothing is reserved ahead, however fast they come:
    the counter is what was used, and the headers exact, as before."""
    limiter = front(url)
    rule = Rule("user:small", requests_per_minute=_CHUNK_SHARE - 1)
    for i in range(5):
        admission = await limiter.admit([rule])
        assert admission.remaining == _CHUNK_SHARE - 1 - (i + 1)
        assert minute_count(limiter.db, "user:small") == i + 1
    assert not limiter._refills
    await limiter.stop()


async def test_requests_per_minute_never_pass_the_limit_across_two_fronts(url: str) -> None:
    """Many requests at once on two fronts: the shared counter never passes the limit, so the
    two together admit at most `limit`; what they may lose is at most one chunk each (reserved
    on one front, unused when the other was refused)."""
    limit = 400
    a, b = front(url), front(url)
    rule = Rule("group:team", requests_per_minute=limit)
    rounds = [await asyncio.gather(admit_all(a, rule, 100), admit_all(b, rule, 100))
              for _ in range(4)]
    admitted = sum(len(x) + len(y) for x, y in rounds)
    chunk = min(_CHUNK_MAX, limit // _CHUNK_SHARE)
    assert limit - 2 * chunk <= admitted <= limit
    assert minute_count(a.db, "group:team") <= limit
    # Both know the minute is spent: refused with no database work.
    writes = writes_to(a)
    with pytest.raises(RateLimited) as refused:
        while True:  # what a still holds, then the refusal
            await a.admit([rule])
    assert refused.value.headers()["X-RateLimit-Limit"] == str(limit)
    assert writes() == 0
    # The next minute starts over.
    a.clock = lambda: T0 + 61
    assert (await a.admit([rule])).limit == limit
    await asyncio.gather(a.stop(), b.stop())


async def test_concurrency_never_passes_the_limit_across_two_fronts(url: str) -> None:
    a, b = front(url), front(url)
    rule = Rule("token:c", max_concurrent=5)
    held_a, held_b = await asyncio.gather(admit_all(a, rule, 8), admit_all(b, rule, 8))
    assert len(held_a) + len(held_b) == 5
    with pytest.raises(RateLimited):
        await b.admit([rule])
    # Ending a request frees its slot on its front at once, with no database work...
    writes = writes_to(a)
    first, *rest = held_a or held_b
    owner = a if held_a else b
    owner.release(first)
    again = await owner.admit([rule])
    assert writes() == 0
    # ...and a slot no request used for a whole flush interval goes back to the database,
    # where the other front finds it.
    other = b if owner is a else a
    for admission in [again, *rest]:
        owner.release(admission)
    await owner._give_back()  # the background loop's step: marks the idle ones
    await owner._give_back()  # unused since: given back
    assert store.usage(a.db, ["token:c"], T0 + 1)["token:c"]["concurrent"] == len(
        held_b if owner is a else held_a)
    assert len(await admit_all(other, rule, 8)) == 5 - len(held_b if owner is a else held_a)
    await asyncio.gather(a.stop(), b.stop())


async def test_tokens_per_day_across_two_fronts_hold_within_two_flushes(url: str) -> None:
    """A front refuses once its own finished requests' tokens reach the quota (before they are
    written), and once another front's are written and read back by its own flush."""
    a, b = front(url), front(url)
    store.set_limit(a.db, "user:ann", requests_per_minute=None, tokens_per_day=100,
                    max_concurrent=None, by=None)
    ann = Principal("ann", False, frozenset({"inference"}), "token", "t1")
    await asyncio.gather(a.refresh(), b.refresh())
    rules = a.rules_for(ann)
    assert rules == [Rule("user:ann", tokens_per_day=100)] == b.rules_for(ann)
    await a.admit(rules)
    await b.admit(rules)
    a.on_record(RequestRecord(None, T0, "ann", "t1", "openai", "/v1/chat/completions", "m",
                              "200", 70, 0, 30, 0.1, 0.2, 0.0, False))
    with pytest.raises(RateLimited):  # its own tokens: at once, nothing written yet
        await a.admit(rules)
    assert (await b.admit(rules)).remaining == 100  # b has not seen them
    await a.flush()  # written
    await b.flush()  # read back
    with pytest.raises(RateLimited) as refused:
        await b.admit(rules)
    assert "used 100 of its 100 tokens" in str(refused.value)
    await asyncio.gather(a.stop(), b.stop())


async def test_a_raised_limit_applies_at_once_after_a_refusal(url: str) -> None:
    """A front remembers that a minute is spent (no database work per refused request), but
    not past an edit of the limit."""
    limiter = front(url)
    with pytest.raises(RateLimited):
        await limiter.admit([Rule("user:u", requests_per_minute=0)])
    assert (await limiter.admit([Rule("user:u", requests_per_minute=3)])).remaining == 2
    await limiter.stop()


async def test_a_lowered_concurrency_limit_holds_across_fronts_holding_slots(url: str) -> None:
    """Two busy fronts hold 2 slots each under max_concurrent 4; the limit goes down to 2. Each
    front must not go on admitting from the slots it holds (4 running together): it asks the
    database, which counts what both hold, and gives back what its ended requests free."""
    a, b = front(url), front(url)
    four, two = Rule("token:t", max_concurrent=4), Rule("token:t", max_concurrent=2)
    held = {a: [await a.admit([four]) for _ in range(2)],
            b: [await b.admit([four]) for _ in range(2)]}
    a.release(held[a].pop())
    b.release(held[b].pop())  # each runs 1 and holds 2
    for limiter in (a, b):
        with pytest.raises(RateLimited):  # 4 held, limit 2
            await limiter.admit([two])
    for limiter in (a, b):
        await limiter._give_back()  # keeps only the slot in use
    with pytest.raises(RateLimited):  # still 2 running: the new limit
        await a.admit([two])
    a.release(held[a].pop())
    await a._give_back()
    assert len(await admit_all(a, two, 3)) == 1  # 2 running in all, no more
    await asyncio.gather(a.stop(), b.stop())
