"""The provider's versioned set of engines (wire/engines.py `EngineSet`, front/engines/provider.py)
and engine overrides looked up by name (front/dispatch/dispatcher.py `engine_spec`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from modelyard.config import Settings
from modelyard.front.dispatch.dispatcher import engine_spec
from modelyard.front.engines.provider import StaticEngines

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


@dataclass
class Named:
    name: str
    up: bool = True


async def test_a_view_is_by_name_and_changes_wait_for_a_newer_one() -> None:
    a, b = Named("engine-0"), Named("engine-1")
    provider = StaticEngines([a, b])  # type: ignore[list-item]
    first = provider.view
    assert first.names == ["engine-0", "engine-1"]
    assert first.get("engine-1") is b and first.get("engine-2") is None
    assert await provider.changed(first.version - 1) is first  # newer already: at once

    waiting = asyncio.ensure_future(provider.changed(first.version))
    await asyncio.sleep(0)  # one turn of the loop: it runs, and waits
    assert not waiting.done()
    provider._publish([b])  # engine-0 removed
    second = await asyncio.wait_for(waiting, 5)
    assert second.version > first.version and second.names == ["engine-1"]
    assert first.names == ["engine-0", "engine-1"]  # a view never changes


def test_engine_overrides_are_found_by_name() -> None:
    specs: Any = {1: {"max_concurrency": 3}}
    settings = Settings(scan_hf_cache=False, engine_specs=specs)
    found = engine_spec(settings, "engine-1")
    assert found is not None and found.max_concurrency == 3
    assert engine_spec(settings, "engine-0") is None
    assert engine_spec(settings, "node-a-engine-x") is None
    assert engine_spec(settings, "gpu-1") is None
    # a cluster engine: the same device group's overrides on every node
    in_cluster = engine_spec(settings, "n2/engine-1")
    assert in_cluster is not None and in_cluster.max_concurrency == 3
    assert engine_spec(settings, "n2/engine-0") is None


def test_a_pin_names_an_engine_by_index_or_by_its_cluster_name() -> None:
    from modelyard.config import LlamaCppModel
    from modelyard.front.dispatch.dispatcher import engine_label

    assert engine_label(2) == "engine-2"
    assert engine_label("n3/engine-0") == "n3/engine-0"
    assert engine_label(None) is None
    spec = LlamaCppModel(id="m", path="/x.gguf", engine="n3/engine-0")
    assert spec.engine == "n3/engine-0"
    assert LlamaCppModel(id="m", path="/x.gguf", engine=1).engine == 1
    with pytest.raises(ValueError):
        LlamaCppModel(id="m", path="/x.gguf", engine=-1)
