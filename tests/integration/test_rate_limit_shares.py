"""Two real fronts (uvicorn, in this process) on one database (SQLite file; PostgreSQL when the
test set-up has one), each admitting a limited caller from its share of the limit in memory
(front/identity/limits.py): many requests at once on both never pass the limit, and lose at most
one reservation chunk per front (docs/teams.md). The limit is decided before the model is looked
up, so an admitted request is any answer but a 429."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from tests.integration.test_rate_limits import CHAT, Clock, front, put, user_token

from modelyard.front.identity.limits import _CHUNK_MAX, _CHUNK_SHARE, Limiter

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def test_two_fronts_admit_at_most_the_limit_when_flooded(
    tmp_path: Path, database_url: str
) -> None:
    limit, per_front = 48, 40
    clock = Clock()
    home = tmp_path / "home"
    async with front(home, clock, database_url) as (a, _), \
            front(home, clock, database_url) as (b, app_b):
        token_id, grace = await user_token(a, "grace")
        assert (await put(a, f"token:{token_id}", requests_per_minute=limit)).status_code == 200
        limiter_b: Limiter = app_b.state.limits
        for _ in range(200):  # front b learns of the edit within limits_refresh_s (0.2 s)
            if limiter_b.active:
                break
            await asyncio.sleep(0.05)
        assert limiter_b.active, "front b never saw the limit"

        async def send(http: httpx.AsyncClient) -> httpx.Response:
            return await http.post("/v1/chat/completions", json=CHAT, headers=grace)

        answers = await asyncio.gather(*(send(http) for _ in range(per_front)
                                         for http in (a, b)))
        refused = [r for r in answers if r.status_code == 429]
        admitted = len(answers) - len(refused)
        chunk = min(_CHUNK_MAX, limit // _CHUNK_SHARE)
        assert limit - 2 * chunk <= admitted <= limit, admitted
        assert all(r.json()["error"]["code"] == "rate_limited" for r in refused)
        assert all(r.headers["X-RateLimit-Limit"] == str(limit) for r in answers)
        [row] = (await a.get("/admin/limits")).json()["limits"]
        assert admitted <= row["usage"]["requests_this_minute"] <= limit
