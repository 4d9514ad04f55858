"""Context variants (`<model>@ctx<N>`, store/registry.py) and Ollama's `options.num_ctx`
(front/chat/context.py): a larger context is a model of its own, estimated with its context."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tests.unit.test_estimate import write_model

from modelyard.config import LlamaCppModel, ServiceModel, Settings
from modelyard.errors import (
    ContextVariantsFull,
    InvalidRequest,
    NumCtxNotAllowed,
    NumCtxTooLarge,
)
from modelyard.front.chat.context import CTX_BOUND, serve_as
from modelyard.store.config_diff import diff_specs, spec_views
from modelyard.store.estimate import estimate_model
from modelyard.store.registry import Entry, ModelRegistry, split_context_variant

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def registry(tmp_path: Path, trained: int | None = 1 << 17) -> ModelRegistry:
    """`tiny` (alias `t`), a GGUF trained for `trained` tokens (None: it does not say)."""
    path = tmp_path / f"tiny-{trained}.gguf"
    write_model(path, context_length=trained)
    spec = LlamaCppModel(id="tiny", path=path, aliases=["t"])
    return ModelRegistry([Entry(spec, "config")])


def test_a_context_variant_is_its_base_with_that_context(tmp_path: Path) -> None:
    reg = registry(tmp_path)
    variant = reg.resolve("tiny@ctx8192")
    assert variant.id == "tiny@ctx8192" and getattr(variant.spec, "ctx_size", None) == 8192
    assert variant.path == reg.resolve("tiny").path and variant.spec.aliases == []
    assert reg.resolve("t:latest@ctx8192") is variant  # any name of the base, the same entry
    assert reg.get("tiny@ctx08192") is None and reg.get("nope@ctx8192") is None
    assert [e.id for e in reg.entries()] == ["tiny"]  # never listed
    assert split_context_variant("a@b@ctx12") == ("a@b", 12)


def test_the_estimate_grows_with_the_context(tmp_path: Path) -> None:
    reg, settings = registry(tmp_path), Settings(home=tmp_path / "home", scan_hf_cache=False)
    base = estimate_model(reg.resolve("tiny").spec, settings)
    big = estimate_model(reg.resolve("tiny@ctx16384").spec, settings)
    assert base is not None and big is not None
    assert big.kv_cache_bytes == base.kv_cache_bytes * 16384 // settings.default_ctx_size


class Engines:
    """What the dispatcher tells of the engines: the models loaded or loading."""

    def __init__(self, *loaded: str) -> None:
        self.loaded = set(loaded)

    async def loaded_models(self) -> set[str]:
        return self.loaded


def front(reg: ModelRegistry, tmp_path: Path, *loaded: str, **settings: Any) -> SimpleNamespace:
    return SimpleNamespace(dispatch=Engines(*loaded), catalog=SimpleNamespace(
        registry=reg, settings=Settings(home=tmp_path / "home", scan_hf_cache=False, **settings)))


async def test_num_ctx_asks_for_a_variant_only_beyond_the_models_context(tmp_path: Path) -> None:
    state = front(registry(tmp_path), tmp_path)
    assert await serve_as(state, "t", None) is None
    assert await serve_as(state, "t", 4096) is None  # the default context covers it
    assert await serve_as(state, "t", 6000) == "t@ctx8192"  # rounded up to a power of two
    assert await serve_as(state, "t", 8192.0) == "t@ctx8192"
    assert await serve_as(state, "unknown", 9000) is None  # the relay says model_not_found
    for bad in (0, -1, "8k", 1.5, True):
        with pytest.raises(InvalidRequest):
            await serve_as(state, "t", bad)


async def test_num_ctx_is_bounded_by_the_trained_context(tmp_path: Path) -> None:
    state = front(registry(tmp_path, trained=16384), tmp_path)
    assert await serve_as(state, "t", 16000) == "t@ctx16384"
    assert await serve_as(state, "t", 12000) == "t@ctx16384"  # 2^14 is the trained context
    with pytest.raises(NumCtxTooLarge, match="16385 is more than the 16384 tokens"):
        await serve_as(state, "t", 16385)
    unsaid = front(registry(tmp_path, trained=None), tmp_path)  # the file does not say
    assert await serve_as(unsaid, "t", CTX_BOUND) == f"t@ctx{CTX_BOUND}"
    with pytest.raises(NumCtxTooLarge, match=f"more than the {CTX_BOUND} tokens"):
        await serve_as(unsaid, "t", CTX_BOUND + 1)


async def test_the_callers_limit_rules_beyond_the_served_context(tmp_path: Path) -> None:
    state = front(registry(tmp_path), tmp_path)
    assert await serve_as(state, "t", 4096, allowed=0) is None  # the served context: always
    assert await serve_as(state, "t", 5000, allowed=5000) == "t@ctx8192"
    with pytest.raises(NumCtxNotAllowed, match="max_num_ctx limit"):
        await serve_as(state, "t", 5001, allowed=5000)


async def test_running_variants_are_reused_and_capped(tmp_path: Path) -> None:
    reg = registry(tmp_path)
    running = front(reg, tmp_path, "tiny@ctx16384", "tiny", "other@ctx8192")
    assert await serve_as(running, "t", 5000) == "t@ctx16384"  # fits: no new server
    assert await serve_as(running, "t", 20000) == "t@ctx32768"  # one of two: a new one
    full = front(reg, tmp_path, "tiny@ctx8192", "tiny@ctx16384")
    assert await serve_as(full, "t", 16384) == "t@ctx16384"
    with pytest.raises(ContextVariantsFull, match="8192, 16384"):
        await serve_as(full, "t", 20000)
    none = front(reg, tmp_path, max_context_variants=0)
    with pytest.raises(ContextVariantsFull):
        await serve_as(none, "t", 5000)
    assert await serve_as(none, "t", 4000) is None


def test_a_service_has_no_context_variant(tmp_path: Path) -> None:
    spec = ServiceModel(id="svc", url="http://127.0.0.1:5002", paths={"speech": "/v1/audio/speech"})
    assert ModelRegistry([Entry(spec, "config")]).get("svc@ctx8192") is None


def test_a_running_variant_restarts_and_goes_with_its_base(tmp_path: Path) -> None:
    old = registry(tmp_path)
    settings = Settings(home=tmp_path / "home", scan_hf_cache=False)
    write_model(tmp_path / "other.gguf")
    moved = ModelRegistry([Entry(LlamaCppModel(id="tiny", path=tmp_path / "other.gguf"),
                                 "config")])
    running = ["tiny", "tiny@ctx8192"]
    diff = diff_specs(spec_views(old, settings, running), spec_views(moved, settings, running))
    assert diff.changed == ["tiny", "tiny@ctx8192"]
    gone = diff_specs(spec_views(old, settings, running),
                      spec_views(ModelRegistry([]), settings, running))
    assert gone.removed == ["tiny", "tiny@ctx8192"]
