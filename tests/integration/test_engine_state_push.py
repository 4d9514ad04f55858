"""Engines push their status on the lease channel (wire/lease.py State): routing a cold model
among several engines reads the front's pushed copies, not each engine's /status, and the copy
follows a load and an unload."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.harness import config
from tests.integration.test_engine_provider import chat, front
from tests.support import fake_model

from modelyard.wire.engines import EngineClient
from modelyard.wire.status import EngineStatus

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def ready_on(engine: EngineClient, model: str) -> bool:
    pushed = engine.latest_status()
    return pushed is not None and any(
        m.model == model and m.resident for m in pushed.models)


async def test_a_cold_route_reads_pushed_state_and_it_follows_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(fake_model("a"), fake_model("b"), simulate_gpus="2x8GiB",
                 engine_devices="per_gpu")
    home = tmp_path / "home"
    async with front(home, cfg) as (url, provider), httpx.AsyncClient(base_url=url) as http:
        engines = provider.view.engines
        assert len(engines) == 2
        for engine in engines:  # both pushed their state right after the hello
            await until(lambda e=engine: e.latest_status() is not None, f"{engine.name}'s state")
        asked: Counter[str] = Counter()
        for engine in engines:
            real = engine.status

            async def counted(name: str = engine.name, real: Any = real) -> EngineStatus:
                asked[name] += 1
                result: EngineStatus = await real()
                return result

            monkeypatch.setattr(engine, "status", counted)
        r = await chat(http, "a")  # cold, two engines: routing compares their snapshots
        assert r.status_code == 200, r.text
        assert asked == Counter(), "routing asked /status instead of reading the pushed state"
        await until(lambda: any(ready_on(e, "a") for e in engines), "a's load pushed")
        holder = next(e for e in engines if ready_on(e, "a"))
        await holder.unload("a")
        await until(lambda: not ready_on(holder, "a"), "a's unload pushed")
