"""The engine over a device group: the policy's decision is placed per device, reported per
device and per model, and an offload's host part is counted in the host ledger."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from modelyard.config import Settings
from modelyard.engine.loop import Engine, ModelState
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
