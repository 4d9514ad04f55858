"""Pull jobs among several fronts on one database (front/ops/jobs.py): a queued job is claimed
by exactly one front, a front starting interrupts only its own or dead fronts' jobs, and the
config epoch moves atomically. On SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from modelyard import db
from modelyard.config import Settings
from modelyard.front.ops import fronts
from modelyard.front.ops.jobs import STALE_CLAIMS, PullJobs

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

INTERVAL_S = 1.0


@pytest.fixture
def database(database_url: str) -> Iterator[sa.Engine]:
    engine = db.connect(database_url)
    yield engine
    engine.dispose()


def _jobs(engine: sa.Engine, tmp_path: Path, front: str) -> PullJobs:
    async def nothing(*_: Any) -> None:
        return None

    def no_spawn(*_: Any, **__: Any) -> Any:
        raise AssertionError("no pull runs in these tests")

    settings = Settings(home=tmp_path, front_sync_interval_s=INTERVAL_S)
    return PullJobs(settings, engine, catalog_changed=nothing, on_pulled=nothing,
                    spawn=no_spawn, front_id=front)


def _job(engine: sa.Engine, job_id: str, status: str, by: str | None,
         at: float | None) -> None:
    with engine.begin() as conn:
        conn.execute(sa.insert(db.jobs).values(
            id=job_id, model=f"org/{job_id}", ref=f"org/{job_id}", status=status,
            quantize="auto", init=False, created_at=time.time(), bytes_done=0,
            claimed_by=by, claimed_at=at))


def _status(engine: sa.Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return {r.id: r.status for r in conn.execute(sa.select(db.jobs.c.id, db.jobs.c.status))}


async def test_a_starting_front_interrupts_only_its_own_and_dead_fronts_jobs(
    database: sa.Engine, tmp_path: Path
) -> None:
    now = time.time()
    stale = now - (STALE_CLAIMS + 1) * INTERVAL_S
    _job(database, "live", "running", "front-a", now)  # another front, renewing its claim
    _job(database, "liveq", "queued", "front-a", now)  # queued there, waiting for a slot
    _job(database, "dead", "running", "front-c", stale)  # a front that stopped renewing
    _job(database, "mine", "running", "front-b", now)  # ours, from before our restart
    _job(database, "old", "running", None, None)  # made before claims existed
    _job(database, "done", "succeeded", "front-c", stale)
    assert await _jobs(database, tmp_path, "front-b").recover() == 3
    assert _status(database) == {"live": "running", "liveq": "queued", "dead": "interrupted",
                                 "mine": "interrupted", "old": "interrupted",
                                 "done": "succeeded"}


async def test_a_queued_job_is_claimed_by_exactly_one_front(
    database: sa.Engine, tmp_path: Path
) -> None:
    for n in range(5):
        _job(database, f"j{n}", "queued", "front-a", time.time())
        racers = [_jobs(database, tmp_path, f"front-{k}") for k in range(4)]
        won = await asyncio.gather(*(r._claim(f"j{n}") for r in racers))
        assert sum(won) == 1, won
        with database.connect() as conn:
            row = conn.execute(sa.select(db.jobs).where(db.jobs.c.id == f"j{n}")).one()
        assert row.status == "running"
        assert row.claimed_by == racers[won.index(True)].front_id


async def test_the_heartbeat_renews_its_claims_and_interrupts_a_dead_fronts(
    database: sa.Engine, tmp_path: Path
) -> None:
    _job(database, "a1", "running", "front-a", 1.0)
    _job(database, "b1", "running", "front-b", 1.0)  # front-b died long ago
    _job(database, "c1", "queued", "front-c", time.time())  # front-c is alive
    await _jobs(database, tmp_path, "front-a").heartbeat()
    with database.connect() as conn:
        at = {r.id: r.claimed_at for r in conn.execute(sa.select(db.jobs))}
    assert at["a1"] > time.time() - 60 and at["b1"] == 1.0
    assert _status(database) == {"a1": "running", "b1": "interrupted", "c1": "queued"}


def test_the_config_epoch_moves_once_per_bump_on_every_front(database: sa.Engine) -> None:
    assert fronts.read_epoch(database) == 0
    assert fronts.bump_epoch(database, "front-a") == 1
    assert fronts.bump_epoch(database, "front-b") == 2
    assert fronts.read_epoch(database) == 2


@pytest.mark.postgres
def test_fronts_starting_together_on_an_empty_database_all_connect(
    postgres_server: Any,
) -> None:
    """create_all checks then creates: fronts starting at the same moment race on it."""
    url = postgres_server.create_database("together")
    start = threading.Barrier(4)

    def front() -> list[str]:
        start.wait()
        engine = db.connect(url)
        try:
            return sorted(sa.inspect(engine).get_table_names())
        finally:
            engine.dispose()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        tables = list(pool.map(lambda _: front(), range(4)))
    assert all(t == tables[0] for t in tables) and "jobs" in tables[0]


@pytest.mark.postgres
async def test_fronts_asked_at_once_for_one_model_make_one_job(
    postgres_server: Any, tmp_path: Path
) -> None:
    """Each front's check for an active job and its insert are one step under a lock on the
    reference: eight fronts asked at the same instant (their own connection pools) make one."""
    url = postgres_server.create_database("submit_race")
    engines = [db.connect(url) for _ in range(8)]
    try:
        fronts_ = [_jobs(e, tmp_path / f"f{k}", f"front-{k}") for k, e in enumerate(engines)]
        for jobs in fronts_:
            jobs._start = lambda job_id: None  # type: ignore[method-assign]  # no pull runs
        for round_ in range(3):
            answers = await asyncio.gather(*(j.submit(f"org/model-{round_}") for j in fronts_))
            assert sum(created for _, created in answers) == 1, answers
            assert len({job["id"] for job, _ in answers}) == 1
            with engines[0].connect() as conn:
                count = conn.execute(sa.select(sa.func.count()).select_from(db.jobs).where(
                    db.jobs.c.ref == f"org/model-{round_}")).scalar_one()
            assert count == 1
    finally:
        for e in engines:
            e.dispose()
