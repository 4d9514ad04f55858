"""Bearer tokens are looked up in the database once per burst (front/identity/auth.py
`Auth.by_token`): requests that find the cache cold at the same time (64 streams starting
together with one token, every _TOKEN_CACHE_S) share one query; a revocation made while a lookup
runs is not hidden by that lookup's answer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from modelyard import db
from modelyard.config import Settings
from modelyard.front.identity import accounts, tokens
from modelyard.front.identity.auth import Auth

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]


def database(tmp_path: Path) -> sa.Engine:
    engine = db.connect(f"sqlite:///{tmp_path / 'm.db'}")
    accounts.add_user(engine, "alice", "long enough")
    return engine


def token_queries(engine: sa.Engine) -> list[str]:
    """The SELECTs on the tokens table `engine` runs from now on."""
    seen: list[str] = []

    def before(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "token_hash" in statement:
            seen.append(statement)

    sa.event.listen(engine, "before_cursor_execute", before)
    return seen


async def test_a_burst_of_requests_with_one_token_makes_one_query(tmp_path: Path) -> None:
    engine = database(tmp_path)
    _, secret = tokens.create_token(engine, "alice", "t", ["inference"])
    auth = Auth(Settings(home=tmp_path), engine, "k" * 32)
    queries = token_queries(engine)
    found = await asyncio.gather(*(auth.by_token(secret) for _ in range(64)))
    assert {t.owner for t in found if t is not None} == {"alice"}
    assert all(t is not None for t in found)
    assert len(queries) == 1, queries  # before: one per request that found the cache cold
    await auth.by_token(secret)  # cached now
    assert len(queries) == 1


async def test_a_waiter_that_leaves_does_not_cancel_the_others_lookup(tmp_path: Path) -> None:
    engine = database(tmp_path)
    _, secret = tokens.create_token(engine, "alice", "t", ["inference"])
    auth = Auth(Settings(home=tmp_path), engine, "k" * 32)
    first = asyncio.ensure_future(auth.by_token(secret))
    second = asyncio.ensure_future(auth.by_token(secret))
    await asyncio.sleep(0)  # both wait on the one lookup
    first.cancel()
    token = await asyncio.wait_for(second, 10)
    assert token is not None and token.owner == "alice"


async def test_a_revocation_during_a_lookup_is_not_hidden_by_its_answer(tmp_path: Path) -> None:
    engine = database(tmp_path)
    made, secret = tokens.create_token(engine, "alice", "t", ["inference"])
    auth = Auth(Settings(home=tmp_path), engine, "k" * 32)
    early = asyncio.ensure_future(auth.by_token(secret))
    await asyncio.sleep(0)  # its lookup has begun
    tokens.revoke_token(engine, made.id)
    auth.forget_tokens()  # what the revoking route does
    await early  # begun before the revocation: whatever it read, it is not kept
    assert await auth.by_token(secret) is None
