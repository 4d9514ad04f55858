"""The lease channel over real loopback sockets, with an engine whose model is a fake process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.support import fake_model

from modelyard.config import OpenAIServerModel, Settings
from modelyard.engine.lease_channel import serve_lease_channel
from modelyard.engine.loop import Engine
from modelyard.errors import ModelNotFound
from modelyard.front.lease_client import LeaseClient
from modelyard.store.registry import ModelRegistry

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def _until(condition: object, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.01)


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    settings = Settings(
        home=tmp_path,
        scan_hf_cache=False,
        models=[
            OpenAIServerModel.model_validate(fake_model("fast")),
            OpenAIServerModel.model_validate(fake_model("slow", "--load-time-s", "1.5")),
        ],
    )
    engine = Engine(settings, ModelRegistry.build(settings))
    yield engine
    await engine.shutdown()


@pytest.fixture
async def channel(engine: Engine) -> AsyncIterator[tuple[Engine, int]]:
    server = await serve_lease_channel(engine)
    yield engine, int(server.sockets[0].getsockname()[1])
    server.close()


async def _flush(client: LeaseClient) -> None:
    """Two round trips: any grant that raced a cancel has come back and been returned."""
    for _ in range(2):
        client.release((await client.acquire("fast")).id)


def _leases(engine: Engine, model: str) -> int:
    return next(m["leases"] for m in engine.model_status() if m["model"] == model)


async def test_acquire_and_release(channel: tuple[Engine, int]) -> None:
    engine, port = channel
    client = await LeaseClient.connect("127.0.0.1", port)
    lease = await client.acquire("fast")
    assert lease.model == "fast" and lease.upstream.startswith("http://127.0.0.1:")
    assert _leases(engine, "fast") == 1
    client.release(lease.id)
    await _until(lambda: _leases(engine, "fast") == 0)
    await client.close()


async def test_errors_come_back_as_the_same_class(channel: tuple[Engine, int]) -> None:
    _, port = channel
    client = await LeaseClient.connect("127.0.0.1", port)
    with pytest.raises(ModelNotFound):
        await client.acquire("ghost")
    await client.close()


async def test_a_closed_connection_gives_its_leases_back(channel: tuple[Engine, int]) -> None:
    engine, port = channel
    client = await LeaseClient.connect("127.0.0.1", port)
    await client.acquire("fast")
    await client.acquire("fast")
    assert _leases(engine, "fast") == 2
    await client.close()  # e.g. the front crashed
    await _until(lambda: _leases(engine, "fast") == 0)


async def test_a_cancelled_wait_leaks_no_lease(channel: tuple[Engine, int]) -> None:
    engine, port = channel
    client = await LeaseClient.connect("127.0.0.1", port)
    waiting = asyncio.create_task(client.acquire("slow"))
    await _until(lambda: any(m["state"] == "loading" for m in engine.model_status()))
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    # The load goes on (others may want it) and ends ready, but with no lease held.
    await _until(lambda: any(m["state"] == "ready" for m in engine.model_status()))
    await _flush(client)
    assert _leases(engine, "slow") == 0
    lease = await client.acquire("slow")
    assert _leases(engine, "slow") == 1
    client.release(lease.id)
    await client.close()
