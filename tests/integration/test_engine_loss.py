"""Engines that die or leave while the front runs (issue 20): a request that has not sent its
first byte yet goes to another engine, each engine once (front/dispatch/reroute.py); and a
startup model on an engine that left is loaded again on another (front/ops/replace.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.harness import TEXT_16, config, status
from tests.integration.test_engine_heartbeat import chat_in_thread, engine_named
from tests.integration.test_engine_provider import engines_listed, front
from tests.support import fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def loading_on(server: Any, engine: str, model: str) -> bool:
    return any(m["model"] == model and m["state"] == "loading"
               for m in engine_named(server, engine)["models"])


def test_a_request_outlives_two_engines_killed_before_its_grant(start_server: Any) -> None:
    """Killed while the request waits for its lease, engine after engine: it is answered by
    the third (the old code routed again once, then answered 503)."""
    cold = fake_model("cold", "--load-time-s", "3")
    server = start_server(config(cold, simulate_gpus="3x8GiB", engine_devices="per_gpu",
                                 default_engine=0))
    assert [e["name"] for e in status(server)["engines"]] == ["engine-0", "engine-1", "engine-2"]
    waiting, result = chat_in_thread(server.url, "cold")
    for victim in ("engine-0", "engine-1"):
        pid = int(engine_named(server, victim)["pid"])
        poll(lambda v=victim: loading_on(server, v, "cold"), timeout_s=20,
             what=f"cold to load on {victim}")
        os.kill(pid, signal.SIGKILL)
    waiting.join(60)
    r = result["response"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == TEXT_16
    ready = [m["model"] for m in engine_named(server, "engine-2")["models"]
             if m["state"] == "ready"]
    assert ready == ["cold"]


async def test_a_startup_model_on_a_removed_engine_is_loaded_on_another(
    tmp_path: Path,
) -> None:
    cfg = config(fake_model("boot"), fake_model("pinned", engine=0),
                 simulate_gpus="2x8GiB", engine_devices="per_gpu", default_engine=0,
                 startup_models=["boot", "pinned"])
    home = tmp_path / "home"
    async with front(home, cfg) as (url, provider), httpx.AsyncClient(base_url=url) as http:
        listed = await engines_listed(http, home)
        assert sorted(m["model"] for m in listed["engine-0"]["models"]) == ["boot", "pinned"]
        assert listed["engine-1"]["models"] == []
        await provider.remove("engine-0")
        t0 = time.monotonic()
        while True:
            listed = await engines_listed(http, home)
            models = {m["model"]: m["state"] for m in listed["engine-1"]["models"]}
            if models.get("boot") == "ready":
                break
            assert time.monotonic() - t0 < 15, f"boot not re-placed: {listed}"
            await asyncio.sleep(0.1)
        # A pin is a hard constraint: the pinned model waits for its engine.
        assert "pinned" not in models
