"""Deleting a pulled model removes its snapshot links and blobs, not what another model shares."""

import os
from pathlib import Path

import pytest

from modelyard.front.api.pulls import _delete_pulled_files

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def link(snapshot: Path, name: str, blob: Path) -> Path:
    path = snapshot / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(os.path.relpath(blob, path.parent))
    return path


def test_a_shared_projector_stays_for_the_other_quant(tmp_path: Path) -> None:
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    for b in ("q4", "q8", "mm"):
        (blobs / b).write_bytes(b"GGUF" + b.encode())
    q4 = link(snap, "Q4/m-Q4_K_M.gguf", blobs / "q4")
    link(snap, "Q8/m-Q8_0.gguf", blobs / "q8")
    mm = link(snap, "mmproj-F16.gguf", blobs / "mm")
    row = {"format": "gguf", "path": str(q4), "files": ["Q4/m-Q4_K_M.gguf", "mmproj-F16.gguf"]}
    other = {"format": "gguf", "path": str(snap / "Q8/m-Q8_0.gguf"),
             "files": ["Q8/m-Q8_0.gguf", "mmproj-F16.gguf"]}

    _delete_pulled_files(row, [other])

    assert not q4.is_symlink() and not (blobs / "q4").exists()
    assert mm.exists() and (blobs / "mm").exists()  # the Q8 model still uses it
    assert (blobs / "q8").exists()

    _delete_pulled_files(other, [])
    assert sorted(p.name for p in blobs.iterdir()) == []
