"""Whether a node sees the front's model files: the storage-id file in `models_dir`.

The front writes a random id into `models_dir/STORAGE_ID_FILE` once; its catalog snapshot carries
it with the path (wire/catalog.py). An engine that reads the same id at the same path shares the
front's storage (a mount at the same path on every node: v1 of multi-node model files); any other
engine has its own, and the files of the models the front pulled are missing there until that
node pulls them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from modelyard.wire.cluster import STORAGE_ID_FILE


def read_storage_id(models_dir: Path) -> str | None:
    try:
        found = (models_dir / STORAGE_ID_FILE).read_text().strip()
    except OSError:
        return None
    return found or None


def ensure_storage_id(models_dir: Path) -> str | None:
    """The id of `models_dir`, written now if it has none (None when it cannot be written: the
    engines then report their files by path only)."""
    found = read_storage_id(models_dir)
    if found is not None:
        return found
    path = models_dir / STORAGE_ID_FILE
    new = secrets.token_hex(16)
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
        # O_EXCL: two fronts starting on one shared folder agree on the first one's id.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return read_storage_id(models_dir)
    except OSError:
        return None
    with contextlib.closing(os.fdopen(fd, "w")) as f:
        f.write(new + "\n")
    return new


def shares_storage(models_dir: Path, storage_id: str | None, front_dir: str | None) -> bool:
    """Whether this node sees the front's `models_dir` (same id, same path)."""
    if storage_id is None or front_dir is None:
        return False
    same_path = Path(front_dir).resolve() == models_dir.resolve()
    return same_path and read_storage_id(models_dir) == storage_id
