"""Which folder a `POST /admin/import {"path": …}` may name (issue 31).

The path comes over HTTP, so it is checked the way a file server checks one, not trusted the way
a command line is (`modelyard serve --import-dir` is):

- The *roots* are the folders modelyard already reads models from: `$MODELYARD_HOME` (its
  `models/` included), each of `model_dirs`, and the HF hub cache (`hf_cache_dir`, else the one
  huggingface_hub would use).
- A relative path is relative to `$MODELYARD_HOME` (never to the front's working directory,
  which nobody chose), and must stay inside it: `../../..` is a 400.
- An absolute path (or `~/…`) names its folder explicitly, so it may lie outside the roots: the
  admin said exactly where. One with `..` in it is explicit only where it lands inside a root.
- Never the kernel's trees: /proc, /sys and /dev are refused whichever way they are reached
  (symlinks included): walking them reads live process and device state, and never ends.

The walk itself is bounded too (store/catalog.py `WalkLimits`), so one request cannot scan a disk.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from modelyard.config import Settings
from modelyard.errors import InvalidRequest
from modelyard.store.catalog import default_hf_cache_dir

SYSTEM_TREES = (Path("/proc"), Path("/sys"), Path("/dev"))


def import_roots(settings: Settings) -> list[Path]:
    """The folders an import may name by a relative or `..` path, resolved."""
    roots = [settings.home, *settings.model_dirs, settings.hf_cache_dir or default_hf_cache_dir()]
    return [Path(os.path.realpath(root.expanduser())) for root in roots]


def _inside(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def resolve_import_dir(raw: str, settings: Settings) -> Path:
    """The folder `raw` names, resolved, or an InvalidRequest (a 400 on `path`) saying why not."""
    try:
        given = Path(raw).expanduser()
        home = Path(os.path.realpath(settings.home.expanduser()))
        # Lexically first: whether the text itself climbs out (symlinks are the owner's own).
        named = Path(os.path.normpath(given if given.is_absolute() else home / given))
        real = Path(os.path.realpath(named))
    except (OSError, RuntimeError, ValueError) as exc:  # a NUL, no such user's ~, a loop
        raise InvalidRequest(f"{raw[:200]!r}: {exc}", param="path") from exc
    if any(_inside(p, SYSTEM_TREES) for p in (named, real)):
        raise InvalidRequest(f"{named} is a system folder (/proc, /sys, /dev): not imported",
                             param="path")
    if not given.is_absolute():
        if not _inside(named, [home]):
            raise InvalidRequest(f"{raw[:200]!r} leaves $MODELYARD_HOME ({home}): name a "
                                 "folder outside it by its absolute path", param="path")
    elif ".." in given.parts and not _inside(named, import_roots(settings)):
        raise InvalidRequest(f"{raw[:200]!r} climbs out of the model folders with '..': name "
                             "the folder by its absolute path", param="path")
    return real
