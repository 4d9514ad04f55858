"""Context variants (`<model>@ctx<N>`, store/registry.py) and Ollama's `options.num_ctx`
(front/chat/context.py): a larger context is a model of its own, estimated with its context."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from tests.unit.test_estimate import write_model

from modelyard.config import LlamaCppModel, ServiceModel, Settings
from modelyard.errors import InvalidRequest
from modelyard.front.chat.context import serve_as
from modelyard.store.config_diff import diff_specs, spec_views
from modelyard.store.estimate import estimate_model
from modelyard.store.registry import Entry, ModelRegistry, split_context_variant

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def registry(tmp_path: Path) -> ModelRegistry:
    write_model(tmp_path / "tiny.gguf")
    spec = LlamaCppModel(id="tiny", path=tmp_path / "tiny.gguf", aliases=["t"])
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


def test_num_ctx_asks_for_a_variant_only_beyond_the_models_context(tmp_path: Path) -> None:
    reg = registry(tmp_path)
    state = SimpleNamespace(catalog=SimpleNamespace(
        registry=reg, settings=Settings(home=tmp_path / "home", scan_hf_cache=False)))
    assert serve_as(state, "t", None) is None
    assert serve_as(state, "t", 4096) is None  # the default context covers it
    assert serve_as(state, "t", 6000) == "t@ctx6144"  # rounded up to a multiple of 256
    assert serve_as(state, "unknown", 9000) is None  # the relay says model_not_found
    for bad in (0, -1, "8k", 1.5, True):
        with pytest.raises(InvalidRequest):
            serve_as(state, "t", bad)


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
