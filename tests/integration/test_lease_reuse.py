"""Lease reuse over a real lease channel to a real engine (its model a fake backend process): a
lease the front gives back is taken again by its next request without a grant, the engine sees
it held meanwhile and released once the linger is over, and a change of the engine's models
(a load) gives kept leases back at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.support import fake_model

from modelyard.config import OpenAIServerModel, Settings
from modelyard.engine.lease_channel import serve_lease_channel
from modelyard.engine.loop import Engine
from modelyard.front.engines.idle_leases import LINGER_S, IdleLeases
from modelyard.front.engines.lease_client import LeaseClient
from modelyard.store.registry import ModelRegistry

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SECRET = "s3cret-for-this-test"


async def _until(condition: object, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.005)


@pytest.fixture
async def channel(tmp_path: Path) -> AsyncIterator[tuple[Engine, LeaseClient]]:
    settings = Settings(home=tmp_path, scan_hf_cache=False,
                        models=[OpenAIServerModel.model_validate(fake_model("fast")),
                                OpenAIServerModel.model_validate(fake_model("other"))])
    engine = Engine(settings, ModelRegistry.build(settings))
    server = await serve_lease_channel(engine, SECRET)
    port = int(server.sockets[0].getsockname()[1])
    client = await LeaseClient.connect("127.0.0.1", port, SECRET, state=True)
    yield engine, client
    await client.close()
    server.close()
    await engine.shutdown()


def _leases(engine: Engine) -> int:
    return next((m["leases"] for m in engine.model_status() if m["model"] == "fast"), 0)


async def test_the_next_request_takes_the_lease_given_back_without_a_grant(
        channel: tuple[Engine, LeaseClient]) -> None:  # fmt: skip
    engine, client = channel
    first = await client.acquire("fast")
    assert first.load_duration_ns > 0  # this grant loaded the model
    client.give_back(first)
    again = client.kept_lease("fast", None)
    assert again is not None and again.id == first.id
    assert again.load_duration_ns == 0  # this request loaded nothing
    assert _leases(engine) == 1  # held all along: the engine saw no release and no grant
    client.give_back(again)
    await asyncio.sleep(LINGER_S)  # idle now: it goes back within the linger
    await _until(lambda: _leases(engine) == 0)
    assert client.kept_lease("fast", None) is None


async def test_a_change_of_the_engines_models_gives_kept_leases_back(
        channel: tuple[Engine, LeaseClient]) -> None:  # fmt: skip
    engine, client = channel
    # Kept far longer than the test: only the engine's State frame can send it back.
    client._idle = IdleLeases(client.release, linger_s=60.0)
    lease = await client.acquire("fast")
    client.give_back(lease)
    assert _leases(engine) == 1
    other = await client.acquire("other")  # a load: the engine's models change
    await _until(lambda: _leases(engine) == 0)
    assert client.kept_lease("fast", None) is None  # never reused past a change
    client.release(other.id)
