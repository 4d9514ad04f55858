"""The front learns its engines from a provider (front/engines/provider.py), by name, and the set
may change while it runs: an engine process removed is no longer routed to nor listed, and one
added back under the same name serves again. The front is `create_app` served on a real socket in
this process (so the test holds its provider); engines and models are real processes.

Also through the seam: a model's log read by a front whose MODELYARD_HOME is not the engine's (it
could not open the engine's files if it tried), and session KV slots restored by the engine."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml
from tests.integration.harness import config
from tests.support import fake_model, free_port

from modelyard.config import load_settings
from modelyard.front.app import create_app
from modelyard.front.engines.provider import LocalEngines
from modelyard.front.engines.supervisor import EnginePlan

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HI = [{"role": "user", "content": "hi"}]


def write_config(home: Path, cfg: dict[str, Any]) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    config_file = home / "config.yaml"
    config_file.write_text(yaml.safe_dump(cfg))
    return config_file


@contextlib.asynccontextmanager
async def front(
    home: Path, cfg: dict[str, Any], engine_home: Path | None = None
) -> AsyncIterator[tuple[str, LocalEngines]]:
    """A front over a `LocalEngines` provider, on a real port; yields its URL and provider.
    The engines' MODELYARD_HOME is `engine_home` (default: the front's)."""
    config_file = write_config(home, cfg)
    settings = load_settings(config_file, home=home)
    provider = LocalEngines(load_settings(config_file, home=engine_home or home),
                            config_file=config_file)
    app = create_app(settings, provider=provider, config_file=config_file)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on",
                                           log_level="warning"))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if serving.done():
                serving.result()  # the startup's error
                raise RuntimeError("the front stopped before it started")
            await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{port}", provider
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 60)


async def chat(http: httpx.AsyncClient, model: str) -> httpx.Response:
    return await http.post("/v1/chat/completions", timeout=30,
                           json={"model": model, "messages": HI, "max_tokens": 2})


async def engines_listed(http: httpx.AsyncClient, home: Path) -> dict[str, dict[str, Any]]:
    token = (home / "cli-token").read_text().strip()
    r = await http.get("/status", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert r.status_code == 200, r.text
    return {e["name"]: e for e in r.json()["engines"]}


async def test_an_engine_starts_though_a_free_port_is_taken_before_it_binds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fresh-clone CI's failure on 149152b: the supervisor chose a free port and the engine
    bound it a second later, by which time another process held it (exit 3, "address already
    in use"). Here every port the supervisor could be told is free is held by the test: the
    engine still starts, on the socket it inherits."""
    from modelyard.front.engines import supervisor

    thief = socket.socket()
    thief.bind(("127.0.0.1", 0))
    thief.listen()
    taken = thief.getsockname()[1]
    monkeypatch.setattr(supervisor, "free_port", lambda host="127.0.0.1": taken, raising=False)
    home = tmp_path / "home"
    try:
        async with front(home, config(fake_model("m1"))) as (url, _provider), \
                httpx.AsyncClient(base_url=url) as http:
            r = await chat(http, "m1")
            assert r.status_code == 200, r.text
            [engine] = (await engines_listed(http, home)).values()
            assert engine["up"], engine
    finally:
        thief.close()


async def test_engines_removed_and_added_back_by_name_while_the_front_runs(
    tmp_path: Path,
) -> None:
    cfg = config(fake_model("anywhere"), fake_model("on-zero", engine=0),
                 simulate_gpus="2x8GiB", engine_devices="per_gpu")
    home = tmp_path / "home"
    async with front(home, cfg) as (url, provider), httpx.AsyncClient(base_url=url) as http:
        first = provider.view
        assert first.names == ["engine-0", "engine-1"]
        assert set(await engines_listed(http, home)) == {"engine-0", "engine-1"}
        assert (await chat(http, "on-zero")).status_code == 200

        await provider.remove("engine-0")
        removed = await asyncio.wait_for(provider.changed(first.version), 10)
        assert removed.names == ["engine-1"]
        assert set(await engines_listed(http, home)) == {"engine-1"}
        # What is up serves; a model pinned to the engine that went is 503, naming it.
        r = await chat(http, "anywhere")
        assert r.status_code == 200, r.text
        assert (await engines_listed(http, home))["engine-1"]["models"][0]["model"] == "anywhere"
        r = await chat(http, "on-zero")
        assert r.status_code == 503 and "engine-0" in r.text, r.text

        await provider.add(EnginePlan(0, ""))
        assert provider.view.names == ["engine-1", "engine-0"]
        listed = await engines_listed(http, home)
        assert set(listed) == {"engine-0", "engine-1"} and listed["engine-0"]["up"]
        r = await chat(http, "on-zero")
        assert r.status_code == 200, r.text
        listed = await engines_listed(http, home)
        assert [m["model"] for m in listed["engine-0"]["models"]] == ["on-zero"]


async def test_a_models_log_comes_from_its_engine_not_the_fronts_disk(tmp_path: Path) -> None:
    """The engine processes live in another MODELYARD_HOME than the front's: the front could not
    read their files if it tried, and still serves the model's log, and follows it."""
    home, engine_home = tmp_path / "front-home", tmp_path / "engine-home"
    async with front(home, config(fake_model("logged")), engine_home) as (url, _), \
            httpx.AsyncClient(base_url=url) as http:
        assert (await chat(http, "logged")).status_code == 200
        admin = {"Authorization": f"Bearer {(home / 'cli-token').read_text().strip()}"}
        body: dict[str, Any] = {}
        for _ in range(100):  # the fake prints its line once ready
            r = await http.get("/admin/logs", params={"model": "logged"}, headers=admin)
            assert r.status_code == 200, r.text
            body = r.json()
            if any("model loaded" in x["text"] for x in body["lines"]):
                break
            await asyncio.sleep(0.1)
        assert any("model loaded" in x["text"] for x in body["lines"]), body
        assert {x["source"] for x in body["lines"]} == {"logged"}
        assert body["next_after"] == body["lines"][-1]["seq"]
        assert list(engine_home.glob("logs/models/*.log"))  # where the engine wrote it
        assert not list(home.glob("logs/models/*"))  # and nothing of it here

        # Followed: a line the backend writes after the stream opened arrives through it.
        params = {"model": "logged", "after": str(body["next_after"])}
        async with http.stream("GET", "/admin/logs/stream", params=params, headers=admin,
                               timeout=30) as stream:
            lines = stream.aiter_lines()
            assert (await asyncio.wait_for(anext(lines), 10)).startswith(":")
            assert (await chat(http, "logged")).status_code == 200  # the fake logs each one
            while not (line := await asyncio.wait_for(anext(lines), 10)).startswith("data: "):
                pass
            assert '"source":"logged"' in line
