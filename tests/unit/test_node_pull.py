"""Pulled models carry their hub origin in the pushed catalog, and an engine whose node pulled
one to another path serves it from there, across later pushes (engine/node_pull.py)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from modelyard.config import LlamaCppModel, Preset, Settings
from modelyard.engine.loop import Engine
from modelyard.engine.node_pull import LocalCopy, pull_argv, pull_here, served_locally
from modelyard.engine.pushed_catalog import PushedCatalog
from modelyard.errors import ModelPullFailed, from_native_body
from modelyard.store.registry import Entry, ModelRegistry, entry_from_json, entry_to_json
from modelyard.wire.cluster import TOKEN_FILE_ENV

pytestmark = [pytest.mark.timeout(30)]

REF, REV = "org/smol-GGUF:Q4_1", "0123456789abcdef0123456789abcdef01234567"


def _pulled(path: Path, revision: str = REV, mmproj: Path | None = None) -> Entry:
    return Entry(LlamaCppModel(id="org/smol-gguf:q4_1", path=path, mmproj=mmproj), "pulled",
                 ref=REF, revision=revision, quantize="auto")


def _settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "node", scan_hf_cache=False, embedding_demo=False,
                    simulate_gpus="1x24GiB")


@pytest.mark.unit
def test_the_hub_origin_travels_with_the_entry(tmp_path: Path) -> None:
    entry = _pulled(tmp_path / "front" / "m.gguf")
    back = entry_from_json(entry_to_json(entry))
    assert (back.ref, back.revision, back.quantize) == (REF, REV, "auto")
    assert back == entry
    local = Entry(LlamaCppModel(id="local", path=tmp_path / "l.gguf"), "config")
    assert entry_from_json(entry_to_json(local)).hub is None
    # An older front's entry (no keys) reads as one without an origin.
    old = {k: v for k, v in entry_to_json(local).items() if k not in ("ref", "revision")}
    assert entry_from_json(old).hub is None
    with pytest.raises(ValueError, match="ref"):
        entry_from_json({**entry_to_json(entry), "ref": 7})


@pytest.mark.unit
def test_presets_context_variants_and_copies_keep_the_origin(tmp_path: Path) -> None:
    entry = _pulled(tmp_path / "m.gguf")
    spec = entry.spec.model_copy(update={"max_replicas": 2})
    registry = ModelRegistry([Entry(spec, "pulled", ref=REF, revision=REV, quantize="auto"),
                              Entry(spec, "pulled", Preset(id="brief", model=spec.id),
                                    ref=REF, revision=REV, quantize="auto")])
    for name in (f"{spec.id}@ctx4096", f"{spec.id}#2", "brief"):
        found = registry.get(name)
        assert found is not None and found.hub == (REF, REV, "auto"), name


def _path(registry: ModelRegistry) -> Path | None:
    entry = registry.get("org/smol-gguf:q4_1")
    assert entry is not None
    return entry.path


@pytest.mark.unit
def test_a_node_s_copy_is_served_from_its_path_across_later_pushes(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    front = tmp_path / "front-hf" / "m.gguf"  # never on this node
    mine = tmp_path / "node-hf" / "m.gguf"
    mine.parent.mkdir()
    mine.write_bytes(b"GGUF")
    catalog = PushedCatalog(pushed_only=True)
    registry = catalog.accept(ModelRegistry([_pulled(front)]).to_snapshot(1), settings)
    assert registry is not None and catalog.missing == ("org/smol-gguf:q4_1",)

    entry = registry.entries()[0]
    assert entry.hub is not None
    registry = catalog.adopt(entry.hub, LocalCopy(mine), registry)
    catalog.refresh(registry, settings.models_dir)
    assert _path(registry) == mine
    assert not catalog.missing

    later = catalog.accept(ModelRegistry([_pulled(front)]).to_snapshot(2), settings)
    assert later is not None and _path(later) == mine
    assert not catalog.missing
    # Another revision is other bytes: not this copy.
    other = catalog.accept(ModelRegistry([_pulled(front, "f" * 40)]).to_snapshot(3), settings)
    assert other is not None and _path(other) == front
    assert catalog.missing == ("org/smol-gguf:q4_1",)


@pytest.mark.unit
def test_the_projector_moves_with_the_model(tmp_path: Path) -> None:
    entry = _pulled(tmp_path / "front" / "m.gguf", mmproj=tmp_path / "front" / "p.gguf")
    assert entry.hub is not None
    copy = LocalCopy(tmp_path / "node" / "m.gguf", tmp_path / "node" / "p.gguf")
    spec = served_locally(entry, {entry.hub: copy}).spec
    assert isinstance(spec, LlamaCppModel)
    assert (spec.path, spec.mmproj) == (copy.path, copy.mmproj)


@pytest.mark.unit
def test_the_node_pulls_the_revision_the_front_pulled(tmp_path: Path) -> None:
    argv = pull_argv(_pulled(tmp_path / "m.gguf"), _settings(tmp_path))
    assert argv[:4] == [sys.executable, "-m", "modelyard.store.pull", f"{REF}@{REV}"]
    assert argv[4:6] == ["--quantize", "auto"]


@pytest.mark.unit
def test_the_front_rebuilds_a_failed_pull_from_its_code() -> None:
    error = ModelPullFailed("pulling 'm' to this node failed (hub_error): down", model="m")
    rebuilt = from_native_body(error.native_body())
    assert type(rebuilt) is ModelPullFailed
    assert (rebuilt.status, rebuilt.code, rebuilt.message) == (503, "model_pull_failed",
                                                               error.message)


@pytest.mark.integration
async def test_a_failed_pull_is_a_load_failure_with_the_pull_s_code(tmp_path: Path) -> None:
    """The node's hub is unreachable (a closed port): the load fails with the pull child's own
    code and message, and the model cools down instead of pulling again at once."""
    env = {TOKEN_FILE_ENV: "x", "HF_ENDPOINT": "http://127.0.0.1:9",
           "HF_HOME": str(tmp_path / "node-hf"), "MODELYARD_PULL_ATTEMPTS": "1",
           "PATH": "/usr/bin:/bin"}
    settings = _settings(tmp_path).model_copy(update={"load_cooldown_s": 60.0})
    engine = Engine(settings, ModelRegistry([]), env=env)
    await engine.rescan(ModelRegistry([_pulled(tmp_path / "front" / "m.gguf")]).to_snapshot(1))
    with pytest.raises(ModelPullFailed,
                       match=r"to this node failed \([a-z_]+\): .*Connection refused") as first:
        await engine.acquire("org/smol-gguf:q4_1")
    with pytest.raises(ModelPullFailed, match="not retried for another") as again:
        await engine.acquire("org/smol-gguf:q4_1")  # the cooldown answers: no second pull
    assert again.value.message.startswith(first.value.message)
    assert engine.status().missing_files == ("org/smol-gguf:q4_1",)


@pytest.mark.integration
async def test_a_pull_that_says_nothing_is_stopped_as_stalled(tmp_path: Path) -> None:
    """A hub that accepts the connection and never answers: the pull child is silent, and
    after `stall_s` the pull is stopped and the load told why."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # never answered, closed at the end

    hub = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = hub.sockets[0].getsockname()[1]
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "node-hf"),
           "MODELYARD_PULL_ATTEMPTS": "1", "PATH": "/usr/bin:/bin"}
    heard: list[str] = []
    started = time.monotonic()
    try:
        with pytest.raises(ModelPullFailed, match="stalled: nothing from the pull for 2 s"):
            await pull_here(_pulled(tmp_path / "front.gguf"), _settings(tmp_path), env,
                            heard.append, stall_s=2.0)
    finally:
        for writer in held:
            writer.close()
        hub.close()
        await hub.wait_closed()
    assert time.monotonic() - started < 15  # not the child's own (longer) HTTP timeout
    assert heard == ["pulling org/smol-gguf:q4_1 to this node"]
