"""An engine whose catalog the front pushes (engine/pushed_catalog.py): in a cluster it builds
its first catalog without the database, takes each snapshot unless an older one crosses a newer
one, reports the storage id it sees and the models whose files its node lacks, and refuses to
load one of those with 503 model_files_missing (the front routes to engines with the files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelyard.config import LlamaCppModel, Settings
from modelyard.engine.loop import Engine
from modelyard.engine.pushed_catalog import catalog_pushed
from modelyard.errors import ModelFilesMissing
from modelyard.store.registry import Entry, ModelRegistry
from modelyard.store.storage_id import ensure_storage_id, read_storage_id, shares_storage
from modelyard.wire.cluster import TOKEN_FILE_ENV

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]


def _settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "node", scan_hf_cache=False, embedding_demo=False,
                    simulate_gpus="1x24GiB")


def test_a_cluster_engine_s_catalog_is_pushed_only(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    assert not catalog_pushed(settings, {})
    assert catalog_pushed(settings, {TOKEN_FILE_ENV: "/etc/modelyard/token"})
    ray = settings.model_copy(update={"cluster": settings.cluster.model_copy(
        update={"mode": "ray"})})
    assert catalog_pushed(ray, {})


async def test_a_node_without_the_files_says_so_and_refuses_to_load(tmp_path: Path) -> None:
    front_dir = tmp_path / "front-models"
    front_id = ensure_storage_id(front_dir)
    assert front_id is not None and ensure_storage_id(front_dir) == front_id  # written once
    here = tmp_path / "here.gguf"
    here.write_bytes(b"GGUF")
    pulled = [Entry(LlamaCppModel(id="org/far:Q4", path=front_dir / "far.gguf"), "pulled"),
              Entry(LlamaCppModel(id="near", path=here), "pulled")]
    snapshot = ModelRegistry(pulled).to_snapshot(2, front_id, str(front_dir))
    settings = _settings(tmp_path)
    engine = Engine(settings, ModelRegistry([]), env={TOKEN_FILE_ENV: "x"})
    assert engine.catalog.pushed_only

    await engine.rescan(snapshot)
    status = engine.status()
    assert status.missing_files == ("org/far:Q4",)
    assert status.storage_id is None  # its own models_dir has no id: not the front's storage
    assert not shares_storage(settings.models_dir, front_id, str(front_dir))
    assert shares_storage(front_dir, front_id, str(front_dir))
    with pytest.raises(ModelFilesMissing, match="not on this node"):
        await engine.acquire("org/far:Q4")

    await engine.rescan(ModelRegistry(pulled[1:]).to_snapshot(1))  # older: crossed a newer one
    assert engine.registry.get("org/far:Q4") is not None
    await engine.rescan(None)  # a pushed-only engine never rebuilds from the database
    assert engine.registry.get("near") is not None
    assert read_storage_id(settings.models_dir) is None
