"""Quotas and rate limits over HTTP, on real fronts served in this process (uvicorn) sharing one
SQLite file: the admin API and its checks, a token over its requests per minute gets 429
rate_limited with Retry-After and X-RateLimit-* in each API's error shape and recovers in the
next window (the limiter's clock is moved, nothing sleeps), edits apply at run time, groups, and
a limit holds across two fronts. No engine is needed: the limit is decided before the model is
looked up, so an admitted request is any answer but a 429."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from starlette.applications import Starlette
from tests.integration.harness import served_in_process

from modelyard.config import load_settings
from modelyard.front.engines.provider import _Published
from modelyard.front.identity.limits import Limiter

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
T0 = 1_800_000_000.0  # a minute boundary


class NoEngines(_Published):
    async def start(self) -> None:
        self._publish([])

    async def stop(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = T0 + 1

    def __call__(self) -> float:
        return self.now


def prepare(home: Path, database_url: str | None = None) -> Starlette:
    from modelyard.front.app import create_app

    home.mkdir(parents=True, exist_ok=True)
    config_file = home / "config.yaml"
    config_file.write_text(yaml.safe_dump({"models": [], "limits_refresh_s": 0.2,
                                           "scan_hf_cache": False, "devices": "cpu",
                                           "database_url": database_url}))
    settings = load_settings(config_file, home=home)
    return create_app(settings, provider=NoEngines(), config_file=config_file)


@contextlib.asynccontextmanager
async def front(
    home: Path, clock: Clock, database_url: str | None = None,
) -> AsyncIterator[tuple[httpx.AsyncClient, Starlette]]:
    app = prepare(home, database_url)
    async with served_in_process(app) as port:
        limiter: Limiter = app.state.limits
        limiter.clock = clock
        token = await asyncio.to_thread(lambda: (home / "cli-token").read_text().strip())
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10,
                                     headers={"Authorization": f"Bearer {token}"}) as http:
            yield http, app


async def user_token(http: httpx.AsyncClient, name: str) -> tuple[str, dict[str, str]]:
    """A user with an inference token: (token id, its headers)."""
    r = await http.post("/admin/users", json={"name": name, "password": "a-long-password"})
    assert r.status_code == 201, r.text
    r = await http.post("/tokens", json={"name": "t", "owner": name})
    assert r.status_code == 201, r.text
    return r.json()["id"], {"Authorization": f"Bearer {r.json()['token']}"}


async def put(http: httpx.AsyncClient, subject: str, **values: Any) -> httpx.Response:
    return await http.put(f"/admin/limits/{subject}", json=values)


async def test_a_token_over_its_rate_gets_429_in_each_api_and_recovers(tmp_path: Path) -> None:
    clock = Clock()
    async with front(tmp_path / "home", clock) as (http, _app):
        token_id, bob = await user_token(http, "bob")
        r = await put(http, f"token:{token_id}", requests_per_minute=2)
        assert r.status_code == 200, r.text
        assert r.json()["updated_by"] == "admin"

        remaining = []
        for _ in range(2):
            r = await http.post("/v1/chat/completions", json=CHAT, headers=bob)
            assert r.status_code != 429, r.text
            assert r.headers["X-RateLimit-Limit"] == "2"
            remaining.append(r.headers["X-RateLimit-Remaining"])
        assert remaining == ["1", "0"]

        clock.now = T0 + 45
        r = await http.post("/v1/chat/completions", json=CHAT, headers=bob)
        assert r.status_code == 429, r.text
        assert r.headers["Retry-After"] == "15"
        assert r.headers["X-RateLimit-Limit"] == "2"
        assert r.headers["X-RateLimit-Remaining"] == "0"
        assert r.headers["X-RateLimit-Reset"] == "15"
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limited")

        r = await http.post("/api/chat", json=CHAT, headers=bob)  # Ollama
        assert r.status_code == 429 and set(r.json()) == {"error"}
        assert "requests of this minute" in r.json()["error"]
        r = await http.post("/v1/messages", headers=bob, json={**CHAT, "max_tokens": 5})
        assert r.status_code == 429
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "rate_limit_error"
        r = await http.post("/chat", json=CHAT, headers=bob)  # native
        assert r.status_code == 429 and r.json()["error"] == "rate_limited"
        assert r.json()["retry_after_s"] == pytest.approx(15)

        # Another caller is not held to bob's token's limit, and gets no X-RateLimit-*.
        r = await http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code != 429 and "X-RateLimit-Limit" not in r.headers

        clock.now = T0 + 61  # the next minute
        r = await http.post("/v1/chat/completions", json=CHAT, headers=bob)
        assert r.status_code != 429, r.text
        assert r.headers["X-RateLimit-Remaining"] == "1"

        r = await http.get("/admin/limits")
        [row] = r.json()["limits"]
        assert row["subject"] == f"token:{token_id}"
        assert row["usage"]["requests_this_minute"] == 1


async def test_edits_apply_at_once_and_groups_share_a_limit(tmp_path: Path) -> None:
    clock = Clock()
    async with front(tmp_path / "home", clock) as (http, _app):
        _, carol = await user_token(http, "carol")
        assert (await put(http, "user:carol", requests_per_minute=0)).status_code == 200
        r = await http.post("/v1/chat/completions", json=CHAT, headers=carol)
        assert r.status_code == 429
        assert (await put(http, "user:carol", requests_per_minute=5)).status_code == 200
        r = await http.post("/v1/chat/completions", json=CHAT, headers=carol)
        assert r.status_code != 429 and r.headers["X-RateLimit-Limit"] == "5"

        # A group's limit is one pool of its members' requests.
        _, dave = await user_token(http, "dave")
        assert (await put(http, "group:research", requests_per_minute=1)).status_code == 200
        for name in ("carol", "dave"):
            r = await http.patch(f"/admin/users/{name}", json={"group": "research"})
            assert r.status_code == 200 and r.json()["group"] == "research"
        users = {u["name"]: u for u in (await http.get("/admin/users")).json()["users"]}
        assert users["dave"]["group"] == "research"
        r = await http.post("/v1/chat/completions", json=CHAT, headers=dave)
        assert r.status_code != 429, r.text
        r = await http.post("/v1/chat/completions", json=CHAT, headers=carol)
        assert r.status_code == 429, r.text
        assert "group:research" in r.json()["error"]["message"]
        r = await http.patch("/admin/users/carol", json={"group": None})
        assert r.status_code == 200 and r.json()["group"] is None
        r = await http.post("/v1/chat/completions", json=CHAT, headers=carol)
        assert r.status_code != 429, r.text

        r = await http.delete("/admin/limits/group:research")
        assert r.status_code == 200
        r = await http.post("/v1/chat/completions", json=CHAT, headers=dave)
        assert r.status_code != 429


async def test_only_admins_edit_and_bad_input_is_a_4xx_with_a_code(tmp_path: Path) -> None:
    async with front(tmp_path / "home", Clock()) as (http, _app):
        _, erin = await user_token(http, "erin")
        r = await http.put("/admin/limits/user:erin", json={"requests_per_minute": 1000},
                           headers=erin)
        assert r.status_code == 403 and r.json()["error"] == "forbidden"
        assert (await http.get("/admin/limits", headers=erin)).status_code == 403
        r = await http.patch("/admin/users/erin", json={"group": "g"}, headers=erin)
        assert r.status_code == 403
        for subject, body in [("bogus", {"requests_per_minute": 1}),
                              ("user:erin", {"requests_per_minute": -1}),
                              ("user:erin", {"rpm": 1}),
                              ("user:erin", {"tokens_per_day": "lots"})]:
            r = await http.put(f"/admin/limits/{subject}", json=body)
            assert r.status_code == 400, (subject, body, r.text)
            assert r.json()["error"] == "invalid_request"
        r = await http.delete("/admin/limits/user:nobody")
        assert r.status_code == 404 and r.json()["error"] == "limit_not_found"
        r = await http.patch("/admin/users/erin", json={"group": "no spaces"})
        assert r.status_code == 400 and r.json()["param"] == "group"
        r = await http.patch("/admin/users/nobody", json={"group": "g"})
        assert r.status_code == 404 and r.json()["error"] == "user_not_found"


async def test_a_limit_holds_across_two_fronts_on_one_database(
    tmp_path: Path, database_url: str
) -> None:
    """On SQLite (one file) and on a real PostgreSQL server (the test set-up's)."""
    clock = Clock()
    home = tmp_path / "home"
    async with front(home, clock, database_url) as (a, _), \
            front(home, clock, database_url) as (b, app_b):
        token_id, frank = await user_token(a, "frank")
        assert (await put(a, f"token:{token_id}", requests_per_minute=3)).status_code == 200
        # Front b learns of the edit within limits_refresh_s (0.2 s here).
        limiter_b: Limiter = app_b.state.limits
        for _ in range(200):
            if limiter_b.active:
                break
            await asyncio.sleep(0.05)
        assert limiter_b.active, "front b never saw the limit"
        statuses = []
        for http in (a, b, a, b, a):
            r = await http.post("/v1/chat/completions", json=CHAT, headers=frank)
            statuses.append(r.status_code == 429)
        assert statuses == [False, False, False, True, True]
