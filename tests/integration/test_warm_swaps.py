"""Warm swaps on a simulated GPU, against real processes: a vLLM server put to sleep instead of
stopped and woken on demand (tests/fakes/fake_vllm.py speaks vLLM's sleep routes and claims
its memory on the simulated device, less while asleep), a sleeping one stopped when a load
needs its memory, and the GGUF read-ahead issued when a load waits for evictions."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.harness import pid_alive
from tests.support import ROOT, fake_model

from modelyard.config import LlamaCppModel, OpenAIServerModel, Settings
from modelyard.engine.loop import Engine
from modelyard.engine.read_ahead import Fadvise
from modelyard.store.registry import ModelRegistry
from modelyard.wire.status import ModelStatus

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

GIB = 2**30
FAKE_VLLM = ROOT / "tests" / "fakes" / "fake_vllm.py"


def vllm_model(model_id: str, files: Path, gib: float, asleep_gib: float) -> OpenAIServerModel:
    """A sleep-mode vLLM holding `gib` awake and `asleep_gib` asleep; its weights file (what
    level-1 sleep copies to host RAM) is 1 MiB."""
    weights = files / f"{model_id}.safetensors"
    weights.write_bytes(b"\0" * 2**20)
    argv = [sys.executable, str(FAKE_VLLM), "--model", "$path", "--host", "$host",
            "--port", "$port", "--served-model-name", "$id", "--enable-sleep-mode",
            "--claim-bytes", str(int(gib * GIB)), "--asleep-bytes", str(int(asleep_gib * GIB)),
            # The POST returns before the sleep shows: the engine must wait for /is_sleeping.
            "--sleep-delay-s", "0.3", "--start-log", str(files / f"{model_id}.starts")]
    return OpenAIServerModel(id=model_id, argv=argv, path=weights, sleep_mode=True,
                             vram_bytes=int(gib * GIB), api_key_env="VLLM_API_KEY")


def llama_fake(model_id: str, gib: float) -> OpenAIServerModel:
    nbytes = int(gib * GIB)
    return OpenAIServerModel.model_validate(
        fake_model(model_id, "--claim-bytes", str(nbytes), vram_bytes=nbytes))


async def engine_with(tmp_path: Path, *models: Any, fadvise: Fadvise | None = None,
                      **settings: Any) -> Engine:
    config = Settings(home=tmp_path / "home", scan_hf_cache=False, simulate_gpus="1x8GiB",
                      models=list(models), **settings)
    return Engine(config, ModelRegistry.build(config), fadvise=fadvise)


@pytest.fixture
def files(tmp_path: Path) -> Path:
    path = tmp_path / "files"
    path.mkdir()
    return path


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


def model(engine: Engine, model_id: str) -> ModelStatus:
    found = engine.status().model(model_id)
    assert found is not None
    return found


async def test_an_evicted_vllm_sleeps_and_wakes_without_a_restart(
    tmp_path: Path, files: Path, http: httpx.AsyncClient
) -> None:
    engine = await engine_with(tmp_path, vllm_model("v", files, 3, 0.25), llama_fake("w", 6))
    try:
        first = await engine.acquire("v")
        engine.release(first.id)
        pid = model(engine, "v").pid
        assert pid is not None

        lease = await engine.acquire("w")  # 3 + 6 GiB > 8: v must give its memory back
        v = model(engine, "v")
        assert (v.state, v.warm, v.memory.host_bytes) == ("stopped", "asleep", 2**20)
        assert pid_alive(pid)
        assert (await http.get(first.upstream + "/fake/calls")).json() == ["sleep 1"]
        assert (await http.get(first.upstream + "/is_sleeping")).json() == {"is_sleeping": True}
        assert engine.status().device.warm_bytes == GIB // 4  # what the sleeper still holds
        engine.release(lease.id)

        again = await engine.acquire("v")  # w is stopped for it; v wakes
        assert again.upstream == first.upstream
        assert (await http.get(first.upstream + "/fake/calls")).json() == ["sleep 1", "wake_up"]
        assert (files / "v.starts").read_text() == f"start {pid}\n"  # never restarted
        body = {"model": "v", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        url = again.upstream + "/v1/chat/completions"
        assert (await http.post(url, json=body)).status_code == 401  # the load's key only
        assert again.api_key is not None and again.api_key == first.api_key  # the same load
        answer = await http.post(url, json=body,
                                 headers={"Authorization": f"Bearer {again.api_key}"})
        assert answer.status_code == 200, answer.text  # awake: a sleeping fake answers 503
        status = engine.status()
        assert status.scheduler.count("warm_loads") == 1
        assert (model(engine, "v").state, model(engine, "v").warm) == ("ready", None)
        assert status.device.warm_bytes == 0
        engine.release(again.id)
    finally:
        await engine.shutdown()
    assert not pid_alive(pid)  # shutdown stops what sleeps too


async def test_a_sleeping_vllm_is_stopped_when_a_load_needs_its_memory(
    tmp_path: Path, files: Path
) -> None:
    engine = await engine_with(tmp_path, vllm_model("v", files, 3, 2), llama_fake("w", 7))
    try:
        engine.release((await engine.acquire("v")).id)
        pid = model(engine, "v").pid
        assert pid is not None
        # v asleep still holds 2 GiB: w (7 GiB) fits only once v is gone, so v goes to sleep,
        # then the load takes its memory back rather than wait or fail.
        lease = await engine.acquire("w")
        assert not pid_alive(pid)
        assert model(engine, "v").warm is None
        assert engine.status().device.warm_bytes == 0
        assert model(engine, "w").state == "ready"
        engine.release(lease.id)
    finally:
        await engine.shutdown()


async def test_a_cold_gguf_is_read_ahead_while_its_load_waits_for_an_eviction(
    tmp_path: Path, files: Path
) -> None:
    gguf = files / "g.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 4096)
    loop = asyncio.get_running_loop()
    hinted = asyncio.Event()
    calls: list[tuple[str, int]] = []

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), advice))
        loop.call_soon_threadsafe(hinted.set)

    g = LlamaCppModel(id="g", path=gguf, vram_bytes=4 * GIB,
                      argv=fake_model("g", "--claim-bytes", str(4 * GIB))["argv"])
    engine = await engine_with(tmp_path, g, llama_fake("a", 6), fadvise=fadvise)
    try:
        engine.release((await engine.acquire("g")).id)  # placed at once: nothing to wait for
        engine.release((await engine.acquire("a")).id)  # evicts g; a is no GGUF
        lease = await engine.acquire("g")  # waits for a's eviction: read g ahead meanwhile
        await asyncio.wait_for(hinted.wait(), 10)
        assert calls == [(str(gguf), os.POSIX_FADV_WILLNEED)]
        engine.release(lease.id)
    finally:
        await engine.shutdown()


async def test_a_reload_that_turns_the_warm_tier_off_stops_what_sleeps(
    tmp_path: Path, files: Path
) -> None:
    engine = await engine_with(tmp_path, vllm_model("v", files, 3, 0.25), llama_fake("w", 6))
    try:
        engine.release((await engine.acquire("v")).id)
        pid = model(engine, "v").pid
        assert pid is not None
        engine.release((await engine.acquire("w")).id)  # v sleeps
        assert model(engine, "v").warm == "asleep" and pid_alive(pid)
        await engine.reload(engine.settings.model_copy(update={"warm_tier_bytes": 0}))
        async with asyncio.timeout(10):
            while pid_alive(pid):  # the drop runs as a task of the engine: await its effect
                await asyncio.sleep(0.02)
        assert model(engine, "v").warm is None
        assert engine.status().device.warm_bytes == 0
    finally:
        await engine.shutdown()
