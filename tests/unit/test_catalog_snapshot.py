"""The catalog the front pushes to engines (wire/catalog.py, store/registry.py): a registry
survives the trip through JSON — declared and pulled models, aliases, configured and created
presets — and a body that is not a catalog is refused with a reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from modelyard.config import LlamaCppModel, Preset, Settings, TransformersModel
from modelyard.store.registry import Entry, ModelRegistry, stored_of
from modelyard.wire.catalog import BadCatalog, CatalogSnapshot

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def _registry(tmp_path: Path) -> tuple[Settings, ModelRegistry]:
    declared = LlamaCppModel(id="tiny", path=tmp_path / "tiny.gguf", aliases=["t"], ctx_size=2048)
    settings = Settings(
        home=tmp_path / "home", scan_hf_cache=False, embedding_demo=False, models=[declared],
        presets=[Preset(id="tiny-long", model="tiny", ctx_size=8192, system="be brief")],
    )
    pulled = [
        Entry(LlamaCppModel(id="org/qwen:Q4_K_M", path=tmp_path / "q.gguf",
                            mmproj=tmp_path / "mm.gguf"), "pulled"),
        Entry(TransformersModel(id="org/st", path=tmp_path / "st", quantize="q4"), "imported"),
    ]
    created = [{"spec": {"id": "qwen-coder", "model": "org/qwen:Q4_K_M",
                         "parameters": {"temperature": 0.1}}, "template": "{{ .Prompt }}"}]
    registry = ModelRegistry.build(settings, stored=(pulled, {"q": "org/qwen:Q4_K_M"}, created))
    return settings, registry


def _through_json(snapshot: CatalogSnapshot) -> CatalogSnapshot:
    return CatalogSnapshot.from_json(orjson.loads(orjson.dumps(snapshot.to_json())))


def test_a_registry_survives_the_trip(tmp_path: Path) -> None:
    _, registry = _registry(tmp_path)
    assert {e.name for e in registry.entries()} == {
        "tiny", "org/qwen:Q4_K_M", "org/st", "tiny-long", "qwen-coder"}
    snapshot = _through_json(registry.to_snapshot(7, "abc", "/models"))
    assert (snapshot.version, snapshot.storage_id, snapshot.models_dir) == (7, "abc", "/models")
    pushed = ModelRegistry.from_snapshot(snapshot)
    assert pushed.entries() == registry.entries()  # specs, sources, presets, templates
    for name in ("t", "q", "TINY:latest", "tiny-long@ctx4096", "org/st"):
        assert pushed.get(name) == registry.get(name), name
    assert pushed.aliases_of("org/qwen:Q4_K_M") == ["q"]
    coder = pushed.resolve("qwen-coder")
    assert coder.source == "created" and coder.template == "{{ .Prompt }}"
    assert coder.preset is not None and coder.preset.parameters == {"temperature": 0.1}
    long = pushed.resolve("tiny-long").spec
    assert isinstance(long, LlamaCppModel) and long.ctx_size == 8192


def test_an_engine_rebuilds_with_a_new_config_from_the_last_snapshot(tmp_path: Path) -> None:
    """A reload on an engine whose catalog is pushed: the database's part comes from the last
    snapshot (pulled models, aliases, created presets), the rest from the new settings."""
    settings, registry = _registry(tmp_path)
    snapshot = registry.to_snapshot(1)
    fewer = settings.model_copy(update={"presets": []})
    rebuilt = ModelRegistry.build(fewer, database=False, stored=stored_of(snapshot))
    assert {e.name for e in rebuilt.entries()} == {
        "tiny", "org/qwen:Q4_K_M", "org/st", "qwen-coder"}
    assert rebuilt.resolve("q").id == "org/qwen:Q4_K_M"
    assert rebuilt.resolve("qwen-coder") == registry.resolve("qwen-coder")


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ([], "JSON object"),
        ({"version": -1, "entries": []}, "version"),
        ({"version": "1", "entries": []}, "version"),
        ({"version": 1}, "entries"),
        ({"version": 1, "entries": [1]}, "entries"),
        ({"version": 1, "entries": [], "aliases": {"a": 1}}, "aliases"),
        ({"version": 1, "entries": [], "storage_id": 5}, "storage_id"),
        ({"format": 99, "version": 1, "entries": []}, "format"),
    ],
)
def test_a_body_that_is_not_a_catalog_is_refused(body: Any, says: str) -> None:
    with pytest.raises(BadCatalog, match=says):
        CatalogSnapshot.from_json(body)


@pytest.mark.parametrize(
    "entry",
    [
        {"spec": {"id": "x", "backend": "nope"}, "source": "pulled"},
        {"spec": {"id": "x", "backend": "llamacpp", "path": "/x.gguf"}, "source": "stolen"},
        {"spec": {"id": "x", "backend": "llamacpp", "path": "/x.gguf"}, "source": "created",
         "preset": {"id": "p"}},
    ],
)
def test_an_entry_this_version_cannot_read_is_a_value_error(entry: dict[str, Any]) -> None:
    snapshot = CatalogSnapshot.from_json({"version": 1, "entries": [entry]})
    with pytest.raises(ValueError):
        ModelRegistry.from_snapshot(snapshot)
