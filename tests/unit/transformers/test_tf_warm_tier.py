"""The warm tier for the in-process transformers backend, on a CPU engine: an unloaded model
keeps its converted module, and loading it again serves from it without reading its files.
(An engine with real loopback sockets: integration, beside the backend's other tests.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelyard.config import Settings, TransformersModel
from modelyard.engine.backends.transformers import backend as tf_backend
from modelyard.engine.loop import Engine
from modelyard.store.registry import ModelRegistry
from modelyard.types import Lease

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, model: Any, tokenizer: Any) -> Path:
    """conftest's tiny random Llama and its tokenizer, saved as a Hugging Face repo."""
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every time the backend reads and converts a model's files."""
    seen: list[str] = []
    real = tf_backend.load_causal_lm

    def counting(spec: TransformersModel, precision: Any, placed: Any = None) -> Any:
        seen.append(spec.id)
        return real(spec, precision, placed)

    monkeypatch.setattr(tf_backend, "load_causal_lm", counting)
    yield seen


def engine_for(repo: Path, home: Path, **settings: Any) -> Engine:
    spec = TransformersModel(id="t", path=repo, max_batch_size=1, prefix_cache_tokens=0,
                             session_cache_tokens=0)
    config = Settings(home=home, scan_hf_cache=False, devices="cpu", models=[spec], **settings)
    return Engine(config, ModelRegistry.build(config))


async def complete(lease: Lease) -> str:
    body = {"model": "t", "prompt": "the quick brown fox", "max_tokens": 6, "temperature": 0}
    async with httpx.AsyncClient(timeout=30) as client:  # with the load's key, as the front
        r = await client.post(lease.upstream + "/v1/completions", json=body,
                              headers={"Authorization": f"Bearer {lease.api_key}"})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


async def test_an_unloaded_model_comes_back_from_the_warm_tier_unread(
    repo: Path, tmp_path: Path, reads: list[str]
) -> None:
    engine = engine_for(repo, tmp_path)
    try:
        lease = await engine.acquire("t")
        before = await complete(lease)
        engine.release(lease.id)
        assert await engine.unload("t")
        status = engine.status()
        t = status.model("t")
        assert t is not None and (t.state, t.warm) == ("stopped", "host")
        assert t.memory.host_bytes and status.device.warm_bytes == t.memory.host_bytes

        lease = await engine.acquire("t")
        assert reads == ["t"]  # loaded once: the second load took the warm module
        assert await complete(lease) == before  # the same weights answer the same
        assert engine.status().scheduler.count("warm_loads") == 1
        assert engine.status().device.warm_bytes == 0
        engine.release(lease.id)
    finally:
        await engine.shutdown()


async def test_without_a_warm_tier_an_unloaded_model_is_read_again(
    repo: Path, tmp_path: Path, reads: list[str]
) -> None:
    engine = engine_for(repo, tmp_path, warm_tier_bytes=0)
    try:
        engine.release((await engine.acquire("t")).id)
        assert await engine.unload("t")
        t = engine.status().model("t")
        assert t is not None and t.warm is None
        engine.release((await engine.acquire("t")).id)
        assert reads == ["t", "t"]
    finally:
        await engine.shutdown()


def test_a_model_spread_over_devices_is_not_suspended(repo: Path, tmp_path: Path) -> None:
    """A split or offloaded load (accelerate's hooks pin each layer to its device) cannot be
    moved to host RAM and back by `.to()`: the warm tier leaves it out."""
    from types import SimpleNamespace

    from modelyard.engine.backends.transformers.loader import Loaded
    from modelyard.engine.backends.transformers.precision import Precision

    backend = tf_backend.TransformersBackend(TransformersModel(id="t", path=repo),
                                             Settings(home=tmp_path))
    precision = Precision(load_in_4bit=False, dtype="float32", why="test")
    spread = SimpleNamespace(hf_device_map={"model.layers.0": 0, "model.layers.1": "cpu"})
    backend._loaded = Loaded(spread, None, precision, "cuda:0")
    assert backend._movable() is None
    whole = SimpleNamespace(hf_device_map={"": 0})
    backend._loaded = Loaded(whole, None, precision, "cuda:0")
    assert backend._movable() is not None
