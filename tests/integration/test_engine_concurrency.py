"""A model's `max_concurrency` holds at the engine, for every front together: each front keeps
its own queue, so two fronts could each admit the model's limit; the engine grants at most that
many leases and hands the next slot to the longest waiter, whichever front it came from. Real
lease channels over loopback (one client per front), a fake model process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.support import fake_model

from modelyard.config import OpenAIServerModel, Settings
from modelyard.engine.lease_channel import serve_lease_channel
from modelyard.engine.loop import Engine
from modelyard.front.engines.lease_client import LeaseClient
from modelyard.store.registry import ModelRegistry

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SECRET = "s3cret-for-this-test"


@pytest.fixture
async def fronts(tmp_path: Path) -> AsyncIterator[tuple[Engine, LeaseClient, LeaseClient]]:
    settings = Settings(home=tmp_path, scan_hf_cache=False, max_concurrency=8, models=[
        OpenAIServerModel.model_validate(fake_model("m", max_concurrency=2))])
    engine = Engine(settings, ModelRegistry.build(settings))
    server = await serve_lease_channel(engine, SECRET)
    port = int(server.sockets[0].getsockname()[1])
    a = await LeaseClient.connect("127.0.0.1", port, SECRET)
    b = await LeaseClient.connect("127.0.0.1", port, SECRET)
    yield engine, a, b
    await a.close()
    await b.close()
    server.close()
    await engine.shutdown()


async def test_two_fronts_together_get_at_most_the_models_concurrency(
    fronts: tuple[Engine, LeaseClient, LeaseClient],
) -> None:
    engine, a, b = fronts
    first = await a.acquire("m")  # loads it
    second = await b.acquire("m")
    third = asyncio.create_task(a.acquire("m"))
    fourth = asyncio.create_task(b.acquire("m"))
    async with asyncio.timeout(5):
        while _waiting(engine) < 2 and not (third.done() and fourth.done()):
            await asyncio.sleep(0.01)
    assert not third.done() and not fourth.done()
    assert len(_leases(engine)) == 2
    b.release(second.id)  # the longest waiter (front a's) gets the slot, not the later one
    lease3 = await asyncio.wait_for(third, 5)
    assert _waiting(engine) == 1 and not fourth.done()
    assert len(_leases(engine)) == 2
    a.release(first.id)
    lease4 = await asyncio.wait_for(fourth, 5)
    a.release(lease3.id)
    b.release(lease4.id)


async def test_a_waiter_that_leaves_passes_its_turn_on(
    fronts: tuple[Engine, LeaseClient, LeaseClient],
) -> None:
    engine, a, b = fronts
    held = [await a.acquire("m"), await b.acquire("m")]
    leaving = asyncio.create_task(a.acquire("m"))
    staying = asyncio.create_task(b.acquire("m"))
    async with asyncio.timeout(5):
        while _waiting(engine) < 2:
            await asyncio.sleep(0.01)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    a.release(held[0].id)
    lease = await asyncio.wait_for(staying, 5)  # the slot was not lost with the leaver
    b.release(lease.id)
    b.release(held[1].id)
    async with asyncio.timeout(5):
        while _leases(engine):
            await asyncio.sleep(0.01)


def _runtime(engine: Engine) -> object:
    return engine._models["m"]


def _leases(engine: Engine) -> set[str]:
    leases: set[str] = _runtime(engine).leases  # type: ignore[attr-defined]
    return leases


def _waiting(engine: Engine) -> int:
    """Requests in the engine's acquire that hold no lease yet."""
    return int(_runtime(engine).waiters)  # type: ignore[attr-defined]
