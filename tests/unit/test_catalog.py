"""store.catalog on real directory trees: model dirs and a Hugging Face hub cache layout."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from modelyard.store.catalog import (
    DiscoveredModel,
    default_hf_cache_dir,
    scan_hf_cache,
    scan_model_dirs,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def gguf(path: Path, n: int = 8, arch: str = "llama") -> Path:
    """Write a real (tiny) GGUF file; `n` varies its size so sums are checkable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, arch)
    writer.add_tensor("output_norm.weight", np.ones(n, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def size(path: Path) -> int:
    return path.stat().st_size


def ids(models: list[DiscoveredModel]) -> list[str]:
    return [m.id for m in models]


# --- model directories -------------------------------------------------------------------


def test_flat_dir_with_mmproj_and_partial_downloads(tmp_path: Path) -> None:
    model = gguf(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf")
    other = gguf(tmp_path / "llava-v1.6.Q4_K_M.gguf")
    proj = gguf(tmp_path / "mmproj-model-f16.gguf", arch="clip")
    gguf(tmp_path / "big.Q8_0.gguf.part")
    gguf(tmp_path / "big.Q8_0.gguf.incomplete")
    gguf(tmp_path / "big.Q8_0.gguf.tmp")
    (tmp_path / "README.md").write_text("not a model")
    (tmp_path / "error-page.gguf").write_text("<html>404</html>")
    (tmp_path / "empty.gguf").write_bytes(b"")

    found = scan_model_dirs([tmp_path])

    assert found == [
        DiscoveredModel(
            id="llava-v1.6.q4_k_m",
            path=other,
            size_bytes=size(other),
            source="dir",
            mmproj=proj,
        ),
        DiscoveredModel(
            id="smollm2-135m-instruct.q4_1",
            path=model,
            size_bytes=size(model),
            source="dir",
            mmproj=proj,
        ),
    ]
    assert found[0].format == "gguf"


def test_recursive_sorted_and_missing_dirs_ignored(tmp_path: Path) -> None:
    gguf(tmp_path / "b" / "deep" / "zeta.gguf")
    gguf(tmp_path / "a" / "alpha.gguf")
    gguf(tmp_path / "mid.gguf")
    found = scan_model_dirs([tmp_path / "does-not-exist", tmp_path])
    assert ids(found) == ["alpha", "mid", "zeta"]
    assert scan_model_dirs([]) == []


def test_hidden_files_and_dirs_are_skipped(tmp_path: Path) -> None:
    gguf(tmp_path / ".trash" / "old.gguf")
    gguf(tmp_path / "._resource-fork.gguf")
    gguf(tmp_path / "real.gguf")
    assert ids(scan_model_dirs([tmp_path])) == ["real"]


def test_mmproj_only_attaches_within_its_directory(tmp_path: Path) -> None:
    gguf(tmp_path / "mmproj-F16.gguf", arch="clip")
    gguf(tmp_path / "vision.gguf")
    gguf(tmp_path / "text" / "plain.gguf")
    by_id = {m.id: m for m in scan_model_dirs([tmp_path])}
    assert set(by_id) == {"vision", "plain"}  # the projector is not a model
    assert by_id["vision"].mmproj == tmp_path / "mmproj-F16.gguf"
    assert by_id["plain"].mmproj is None


def test_prefers_bf16_then_f16_then_f32_projector(tmp_path: Path) -> None:
    gguf(tmp_path / "mmproj-F32.gguf", arch="clip")
    gguf(tmp_path / "mmproj-F16.gguf", arch="clip")
    gguf(tmp_path / "m.gguf")
    assert scan_model_dirs([tmp_path])[0].mmproj == tmp_path / "mmproj-F16.gguf"
    gguf(tmp_path / "mmproj-BF16.gguf", arch="clip")
    assert scan_model_dirs([tmp_path])[0].mmproj == tmp_path / "mmproj-BF16.gguf"


def test_split_model_listed_once_with_summed_size(tmp_path: Path) -> None:
    shards = [
        gguf(tmp_path / f"Big-Model.Q4_K_M-{i:05d}-of-00003.gguf", n=8 * i) for i in (1, 2, 3)
    ]
    found = scan_model_dirs([tmp_path])
    assert len(found) == 1
    assert found[0].id == "big-model.q4_k_m"
    assert found[0].path == shards[0]
    assert found[0].size_bytes == sum(size(s) for s in shards)


def test_incomplete_split_set_is_skipped(tmp_path: Path) -> None:
    gguf(tmp_path / "half-00001-of-00002.gguf")
    gguf(tmp_path / "half-00002-of-00002.gguf.part")
    gguf(tmp_path / "whole.gguf")
    assert ids(scan_model_dirs([tmp_path])) == ["whole"]


def test_symlinked_files_and_dirs_are_followed(tmp_path: Path) -> None:
    store = tmp_path / "store"
    blob = gguf(store / "blob-file", n=64)
    models = tmp_path / "models"
    models.mkdir()
    (models / "linked.gguf").symlink_to(blob)
    (models / "broken.gguf").symlink_to(store / "gone")
    gguf(tmp_path / "elsewhere" / "via-dir.gguf")
    (models / "more").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (models / "more" / "loop").symlink_to(models, target_is_directory=True)

    found = scan_model_dirs([models])

    assert ids(found) == ["linked", "via-dir"]
    assert found[0].path == models / "linked.gguf"
    assert found[0].size_bytes == size(blob)  # the target's size, not the link's


def test_same_file_through_two_roots_is_listed_once(tmp_path: Path) -> None:
    gguf(tmp_path / "sub" / "m.gguf")
    found = scan_model_dirs([tmp_path, tmp_path / "sub"])
    assert ids(found) == ["m"]
    assert found[0].path == tmp_path / "sub" / "m.gguf"


def test_id_collisions_get_parent_dir_prefix(tmp_path: Path) -> None:
    root_a, root_b = tmp_path / "models", tmp_path / "Extra"
    first = gguf(root_a / "Qwen.Q4_0.gguf")
    nested = gguf(root_a / "Mirror" / "qwen.Q4_0.gguf")
    deeper = gguf(root_a / "x" / "Mirror" / "qwen.q4_0.gguf")
    other_root = gguf(root_b / "qwen.Q4_0.gguf")

    found = {m.id: m.path for m in scan_model_dirs([root_a, root_b])}

    assert found == {
        "qwen.q4_0": first,  # shallowest file of the first root keeps the plain id
        "mirror/qwen.q4_0": nested,
        "x/mirror/qwen.q4_0": deeper,  # "mirror/..." taken: one more level
        "extra/qwen.q4_0": other_root,
    }


def test_scan_is_deterministic(tmp_path: Path) -> None:
    for name in ("c", "a", "b"):
        gguf(tmp_path / name / "same.gguf")
    assert scan_model_dirs([tmp_path]) == scan_model_dirs([tmp_path])
    assert ids(scan_model_dirs([tmp_path])) == ["b/same", "c/same", "same"]


# --- Hugging Face hub cache --------------------------------------------------------------


def hf_file(repo_dir: Path, revision: str, rel: str, n: int = 8, arch: str = "llama") -> Path:
    """Put a blob in `blobs/` and link it from the snapshot the way huggingface_hub does."""
    tmp = repo_dir / "tmp-blob"
    gguf(tmp, n=n, arch=arch)
    digest = hashlib.sha256(tmp.read_bytes() + rel.encode()).hexdigest()
    blob = repo_dir / "blobs" / digest
    blob.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(blob)
    link = repo_dir / "snapshots" / revision / rel
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))  # relative, like the hub client
    return link


def set_main(repo_dir: Path, revision: str) -> None:
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(revision)


REV_OLD = "1" * 40
REV_NEW = "2" * 40


def test_hf_cache_uses_refs_main_and_quant_ids(tmp_path: Path) -> None:
    repo = tmp_path / "models--bartowski--SmolLM2-135M-Instruct-GGUF"
    hf_file(repo, REV_OLD, "SmolLM2-135M-Instruct-Q8_0.gguf")
    q4 = hf_file(repo, REV_NEW, "SmolLM2-135M-Instruct-Q4_K_M.gguf", n=32)
    hf_file(repo, REV_NEW, "SmolLM2-135M-Instruct-f16.gguf")
    set_main(repo, REV_NEW)
    os.utime(repo / "snapshots" / REV_OLD, (2e9, 2e9))  # newer on disk, but not main

    found = scan_hf_cache(tmp_path)

    assert ids(found) == [
        "bartowski/SmolLM2-135M-Instruct-GGUF:F16",
        "bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M",
    ]
    assert found[1].path == q4
    assert found[1].size_bytes == size(q4.resolve())
    assert found[1].source == "hf_cache"


def test_hf_cache_falls_back_to_newest_snapshot(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--m"
    hf_file(repo, REV_OLD, "m-Q8_0.gguf")
    hf_file(repo, REV_NEW, "m-Q4_0.gguf")
    os.utime(repo / "snapshots" / REV_OLD, (1e9, 1e9))
    os.utime(repo / "snapshots" / REV_NEW, (2e9, 2e9))
    assert ids(scan_hf_cache(tmp_path)) == ["org/m:Q4_0"]
    set_main(repo, "f" * 40)  # points at a snapshot that is not there
    assert ids(scan_hf_cache(tmp_path)) == ["org/m:Q4_0"]


def test_hf_cache_duplicate_or_missing_tags_use_paths(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--multi"
    hf_file(repo, REV_NEW, "a-Q4_K_M.gguf")
    hf_file(repo, REV_NEW, "b-Q4_K_M.gguf")
    hf_file(repo, REV_NEW, "plain.gguf")
    hf_file(repo, REV_NEW, "c-Q8_0.gguf")
    set_main(repo, REV_NEW)
    assert ids(scan_hf_cache(tmp_path)) == [
        "org/multi/a-Q4_K_M.gguf",
        "org/multi/b-Q4_K_M.gguf",
        "org/multi/plain.gguf",
        "org/multi:Q8_0",
    ]


def test_hf_cache_split_mmproj_broken_links_and_partials(tmp_path: Path) -> None:
    repo = tmp_path / "models--unsloth--Vision-GGUF"
    proj = hf_file(repo, REV_NEW, "mmproj-F16.gguf", arch="clip")
    shard1 = hf_file(repo, REV_NEW, "UD-Q4_K_XL/Vision-UD-Q4_K_XL-00001-of-00002.gguf", n=16)
    shard2 = hf_file(repo, REV_NEW, "UD-Q4_K_XL/Vision-UD-Q4_K_XL-00002-of-00002.gguf", n=32)
    hf_file(repo, REV_NEW, "Vision-Q8_0.gguf")
    broken = hf_file(repo, REV_NEW, "Vision-Q2_K.gguf")
    broken.resolve().unlink()  # blob deleted: dangling link
    (repo / "blobs" / "abc.incomplete").write_bytes(b"GGUF")  # download in progress
    set_main(repo, REV_NEW)

    found = {m.id: m for m in scan_hf_cache(tmp_path)}

    assert set(found) == {"unsloth/Vision-GGUF:Q4_K_XL", "unsloth/Vision-GGUF:Q8_0"}
    split = found["unsloth/Vision-GGUF:Q4_K_XL"]
    assert split.path == shard1
    assert split.size_bytes == size(shard1.resolve()) + size(shard2.resolve())
    # The projector at the repo root serves the quant in the sub-folder too.
    assert split.mmproj == proj
    assert found["unsloth/Vision-GGUF:Q8_0"].mmproj == proj


def test_hf_cache_ignores_non_model_repos_and_missing_cache(tmp_path: Path) -> None:
    hf_file(tmp_path / "datasets--org--data", REV_NEW, "x-Q4_0.gguf")
    hf_file(tmp_path / "models--gpt2", REV_NEW, "gpt2-Q4_0.gguf")
    (tmp_path / "models--org--empty" / "snapshots").mkdir(parents=True)
    (tmp_path / "version.txt").write_text("1")
    assert ids(scan_hf_cache(tmp_path)) == ["gpt2:Q4_0"]
    assert scan_hf_cache(tmp_path / "nope") == []


def test_default_hf_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_hf_cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert default_hf_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    assert default_hf_cache_dir() == tmp_path / "hub-cache"
