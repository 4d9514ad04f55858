from pathlib import Path

import pytest

from modelyard.config import DEMO_MODEL_FILE, LlamaCppModel, Settings
from modelyard.errors import ModelNotFound
from modelyard.store.registry import ModelRegistry

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

GGUF_MAGIC = b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 16


def _settings(tmp_path: Path, **kw: object) -> Settings:
    return Settings(home=tmp_path / "home", scan_hf_cache=False, **kw)  # type: ignore[arg-type]


def test_demo_model_is_served_as_smollm2(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    settings.models_dir.mkdir(parents=True)
    (settings.models_dir / DEMO_MODEL_FILE).write_bytes(GGUF_MAGIC)
    registry = ModelRegistry.build(settings)
    assert [e.id for e in registry.entries()] == ["smollm2"]
    entry = registry.resolve("smollm2")
    assert entry.source == "demo" and entry.format == "gguf"
    assert registry.resolve("SmolLM2:latest") is entry


def test_no_models_without_demo(tmp_path: Path) -> None:
    assert ModelRegistry.build(_settings(tmp_path)).entries() == []


def test_declared_models_win_and_aliases_resolve(tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    other.mkdir()
    path = other / "tiny.q8_0.gguf"
    path.write_bytes(GGUF_MAGIC)
    declared = LlamaCppModel(id="tiny", path=path, aliases=["t"])
    registry = ModelRegistry.build(_settings(tmp_path, models=[declared], model_dirs=[other]))
    assert [e.id for e in registry.entries()] == ["tiny"]  # not listed twice
    assert registry.resolve("t").id == "tiny"
    with pytest.raises(ModelNotFound):
        registry.resolve("tiny.q8_0")


def test_discovered_gguf_is_listed(tmp_path: Path) -> None:
    other = tmp_path / "dir"
    other.mkdir()
    (other / "Foo-7B.Q4_K_M.gguf").write_bytes(GGUF_MAGIC)
    registry = ModelRegistry.build(_settings(tmp_path, model_dirs=[other]))
    entry = registry.resolve("foo-7b.q4_k_m")
    assert entry.source == "dir" and entry.size_bytes == len(GGUF_MAGIC)
