"""A modelyard server tunes the cyclic garbage collector once it serves (serving.py): what it
built to start is frozen out of collections, and young collections run at GC_THRESHOLDS."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from typing import Any

import pytest

from modelyard.serving import GC_THRESHOLDS, GracefulServer, server_config

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "lifespan"
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


@pytest.fixture
def gc_restored() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


async def test_a_started_server_freezes_its_start_and_sets_the_thresholds(gc_restored: None
                                                                          ) -> None:
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    server = GracefulServer(server_config(app, host="127.0.0.1", port=0))  # type: ignore[arg-type]
    serving = asyncio.create_task(server.serve())
    while not server.started:
        assert not serving.done(), "the server did not start"
        await asyncio.sleep(0.01)
    try:
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == GC_THRESHOLDS
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
