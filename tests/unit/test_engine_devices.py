"""The engine over a device group: the policy's decision is placed per device, reported per
device and per model, and an offload's host part is counted in the host ledger."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from modelyard.config import Settings
from modelyard.engine.loop import Engine
from modelyard.engine.runtime import ModelState
from modelyard.placement import policy as scheduler
from modelyard.store.registry import ModelRegistry

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]

GIB = 2**30


def _fake(model_id: str, gib: int, **fields: Any) -> dict[str, Any]:
    return {"id": model_id, "backend": "openai", "argv": ["true"], "vram_bytes": gib * GIB,
            **fields}


async def _engine(tmp_path: Path, *models: dict[str, Any]) -> Engine:
    settings = Settings(home=tmp_path, scan_hf_cache=False, simulate_gpus="2x24GiB",
                        models=list(models))  # type: ignore[arg-type]
    return Engine(settings, ModelRegistry.build(settings))


async def test_a_big_model_is_placed_over_both_devices_and_reported_so(tmp_path: Path) -> None:
    engine = await _engine(tmp_path, _fake("big", 40))
    rt = engine._runtime(engine.registry.resolve("big"))
    decision = engine._decide(rt)
    assert isinstance(decision, scheduler.Load) and decision.placement is not None
    assert decision.placement.devices == (0, 1)
    status = engine.status()
    assert [d.index for d in status.devices] == [0, 1]
    assert status.device.total_bytes == 48 * GIB and status.host is not None


async def test_offload_follows_the_spec_and_the_host_part_is_counted(tmp_path: Path) -> None:
    engine = await _engine(tmp_path, _fake("auto", 50, offload="auto"), _fake("off", 50))
    off = engine._decide(engine._runtime(engine.registry.resolve("off")))
    assert isinstance(off, scheduler.NoFit)
    auto = engine._runtime(engine.registry.resolve("auto"))
    decision = engine._decide(auto)
    assert isinstance(decision, scheduler.Load) and decision.placement is not None
    assert decision.placement.host_bytes == 2 * GIB
    before = engine._host_status()
    assert before is not None and before.free_bytes is not None
    auto.state, auto.placement = ModelState.READY, decision.placement
    after = engine._host_status()
    assert after is not None and after.free_bytes is not None
    # Its host part is held in the ledger whatever the host reading says (mapped file pages
    # read as available); the reading moves a little between the two calls.
    assert before.free_bytes - after.free_bytes > GIB


async def test_the_hottest_gpu_of_the_group_pauses_its_engine(tmp_path: Path) -> None:
    sensors = tmp_path / "sensors.json"
    sensors.write_text(json.dumps({"cpu": 40, "gpu0": 50, "gpu1": 95}))
    settings = Settings(home=tmp_path, scan_hf_cache=False, simulate_gpus="2x24GiB",
                        thermal={"simulated_sensors_file": sensors})  # type: ignore[arg-type]
    engine = Engine(settings, ModelRegistry.build(settings))
    paused = asyncio.Event()
    reasons: list[str | None] = []

    def heard(reason: str | None) -> None:
        reasons.append(reason)
        paused.set()

    engine.set_paused = heard  # type: ignore[method-assign]
    watch = asyncio.create_task(engine._watch_thermal())
    try:
        await asyncio.wait_for(paused.wait(), 10)
    finally:
        watch.cancel()
    assert reasons[0] is not None and "gpu 1" in reasons[0]


async def test_vllm_splits_only_over_a_divisor_of_its_heads(tmp_path: Path) -> None:
    """A safetensors model served by vLLM (a child server) on 3 devices: 40 GiB fits 2 of
    them, but its 3 heads only divide 1 or 3, so it goes over 3; the in-process transformers
    engine (device_map) may take 2."""
    from modelyard.engine.backends.base import vllm_spec
    from modelyard.engine.backends.openai_server import ChildServer

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text(json.dumps({"num_attention_heads": 3}))
    settings = Settings(home=tmp_path, scan_hf_cache=False, simulate_gpus="3x24GiB",
                        models=[{"id": "tp", "backend": "transformers", "path": str(repo),
                                 "vram_bytes": 40 * GIB}])  # type: ignore[list-item]
    engine = Engine(settings, ModelRegistry.build(settings))
    rt = engine._runtime(engine.registry.resolve("tp"))
    assert engine._decide(rt).placement.devices == (0, 1)  # type: ignore[union-attr]
    vllm = ChildServer(vllm_spec(rt.spec), settings)  # type: ignore[arg-type]
    rt.split_sizes = engine._split_sizes(rt.spec, vllm)
    assert rt.split_sizes == frozenset({1, 3})
    decision = engine._decide(rt)
    assert isinstance(decision, scheduler.Load) and decision.placement is not None
    assert decision.placement.devices == (0, 1, 2)
