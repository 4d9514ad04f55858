"""Discovery of models on disk: GGUF files in plain model directories and the Hugging Face hub
cache, and safetensors repos in the hub cache (listed as transformers models when their
architecture is one modelyard serves: store.kinds).

Discovery only looks at names, sizes and the 4-byte GGUF magic; reading metadata is
`store.gguf`'s job and happens when a model is shown or loaded, so listing stays fast on
directories holding hundreds of gigabytes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from modelyard.store.gguf import is_mmproj, parse_split_name, quant_tag_from_filename, shard_paths
from modelyard.store.kinds import repo_kind

PARTIAL_SUFFIXES: tuple[str, ...] = (".part", ".incomplete", ".tmp")

# When a directory holds several projectors, prefer BF16, then F16, then F32 (closest to the
# weights the projector was trained in, at half the size of F32).
_MMPROJ_RANK = {"BF16": 0, "F16": 1, "F32": 2}


@dataclass(frozen=True, kw_only=True)
class DiscoveredModel:
    """A model file found on disk (the first shard, for a split model)."""

    id: str
    path: Path  # as found (a symlink stays a symlink: HF cache paths name the snapshot)
    size_bytes: int  # resolved size, summed over shards
    format: Literal["gguf", "safetensors"] = "gguf"  # safetensors: `path` is the repo folder
    source: Literal["dir", "hf_cache"]
    mmproj: Path | None = None


@dataclass(frozen=True)
class _Found:
    path: Path
    size_bytes: int
    mmproj: Path | None


def _is_candidate_name(name: str) -> bool:
    lower = name.lower()
    if name.startswith("."):
        return False  # hidden files, e.g. macOS "._x.gguf" resource forks
    if lower.endswith(PARTIAL_SUFFIXES):
        return False
    return lower.endswith(".gguf")


def _gguf_size(path: Path) -> int | None:
    """Resolved size of a readable GGUF file, else None (broken link, not GGUF, unreadable)."""
    try:
        size = path.stat().st_size  # follows symlinks
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError:
        return None
    return size if magic == b"GGUF" else None


def _pick_mmproj(projectors: list[Path]) -> Path | None:
    if not projectors:
        return None

    def rank(p: Path) -> tuple[int, str]:
        return _MMPROJ_RANK.get(quant_tag_from_filename(p.name) or "", 9), p.name

    return min(projectors, key=rank)


def _models_in_dir(files: Iterable[Path]) -> tuple[list[_Found], Path | None]:
    """The models among one directory's files, and the projector chosen for them."""
    sizes: dict[Path, int] = {}
    for path in files:
        if _is_candidate_name(path.name):
            size = _gguf_size(path)
            if size is not None:
                sizes[path] = size
    mmproj = _pick_mmproj(sorted(p for p in sizes if is_mmproj(p)))
    found: list[_Found] = []
    for path in sorted(sizes):
        if is_mmproj(path):
            continue
        split = parse_split_name(path.name)
        if split is None or split.count == 1:
            found.append(_Found(path, sizes[path], mmproj))
        elif split.number == 1:
            shards = shard_paths(path, split)
            # A set with a shard missing is still downloading (or broken): not loadable yet.
            if all(s in sizes for s in shards):
                found.append(_Found(path, sum(sizes[s] for s in shards), mmproj))
    return found, mmproj


def model_stem(path: Path) -> str:
    """`SmolLM2-135M-Instruct.Q4_1.gguf` -> `smollm2-135m-instruct.q4_1` (split suffix dropped)."""
    split = parse_split_name(path.name)
    stem = split.prefix if split is not None else path.name[: -len(".gguf")]
    return stem.lower()


@dataclass(frozen=True)
class WalkLimits:
    """How much one walk may look at: a folder named over HTTP (`POST /admin/import`) could be
    `/`. Folders deeper than `max_depth` below the root are not looked into; past `max_entries`
    names or `max_s` seconds the walk stops with WalkTooLarge."""

    max_depth: int
    max_entries: int
    max_s: float


class WalkTooLarge(Exception):
    """A walk went past its WalkLimits (the message says which)."""


def _walk(root: Path, limits: WalkLimits | None = None) -> Iterable[tuple[Path, list[Path]]]:
    """(directory, files) for every directory under root, following directory symlinks once."""
    seen: set[str] = set()
    entries = 0
    deadline = time.monotonic() + limits.max_s if limits else 0.0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:  # a symlink loop or a second link to the same directory
            dirnames[:] = []
            continue
        seen.add(real)
        if limits is not None:
            entries += len(dirnames) + len(filenames)
            if entries > limits.max_entries:
                raise WalkTooLarge(f"{root} holds more than {limits.max_entries} files and "
                                   "folders")
            if time.monotonic() > deadline:
                raise WalkTooLarge(f"walking {root} took more than {limits.max_s:g} s")
            if len(Path(dirpath).relative_to(root).parts) >= limits.max_depth:
                dirnames[:] = []
        # Sorted, so which of two links to one directory wins does not depend on the filesystem.
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        yield Path(dirpath), [Path(dirpath, f) for f in sorted(filenames)]


def _unique_id(path: Path, base: str, used: set[str]) -> str:
    """`base`, else `parent/base`, `grandparent/parent/base`, ..., else `base-2`, ..."""
    if base not in used:
        return base
    prefix = ""
    for parent in path.parents:
        if not parent.name:
            break
        prefix = f"{parent.name.lower()}/{prefix}"
        candidate = f"{prefix}{base}"
        if candidate not in used:
            return candidate
    n = 2
    while f"{base}-{n}" in used:
        n += 1
    return f"{base}-{n}"


def scan_model_dirs(
    dirs: Iterable[Path], limits: WalkLimits | None = None
) -> list[DiscoveredModel]:
    """Find GGUF models under each directory (recursively); missing directories are ignored.
    With `limits`, each directory's walk is bounded (WalkTooLarge past them).

    Ids are lowercased file stems; on a clash, the file found later (later root, then deeper,
    then later in name order) gets its parent directory prefixed. Sorted by id.
    """
    ordered: list[tuple[int, int, str, _Found]] = []
    for root_no, root in enumerate(dirs):
        root = Path(root).expanduser()
        if not root.is_dir():
            continue
        for _directory, files in _walk(root, limits):
            found, _ = _models_in_dir(files)
            for f in found:
                rel = f.path.relative_to(root)
                ordered.append((root_no, len(rel.parts), rel.as_posix(), f))
    ordered.sort(key=lambda item: item[:3])

    used: set[str] = set()
    seen_real: set[str] = set()
    out: list[DiscoveredModel] = []
    for _, _, _, f in ordered:
        real = os.path.realpath(f.path)
        if real in seen_real:  # the same file reached twice (overlapping roots, file symlinks)
            continue
        seen_real.add(real)
        model_id = _unique_id(f.path, model_stem(f.path), used)
        used.add(model_id)
        out.append(
            DiscoveredModel(
                id=model_id, path=f.path, size_bytes=f.size_bytes, source="dir", mmproj=f.mmproj
            )
        )
    return sorted(out, key=lambda m: m.id)


def default_hf_cache_dir() -> Path:
    """The hub cache huggingface_hub would use, from the environment at call time."""
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HUGGINGFACE_HUB_CACHE"):  # the older name, still honoured by huggingface_hub
        return Path(env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser() / "huggingface" / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def _repo_id(dirname: str) -> str | None:
    """`models--org--name` -> `org/name` (`models--gpt2` -> `gpt2`); None for datasets, spaces."""
    parts = dirname.split("--")
    if parts[0] != "models" or len(parts) < 2 or not all(parts[1:]):
        return None
    return "/".join(parts[1:])


def _pick_snapshot(repo_dir: Path) -> Path | None:
    snapshots = repo_dir / "snapshots"
    try:
        revision = (repo_dir / "refs" / "main").read_text(encoding="utf-8").strip()
    except OSError:
        revision = ""
    if revision and (snapshots / revision).is_dir():
        return snapshots / revision
    try:
        candidates = [p for p in snapshots.iterdir() if p.is_dir()]
    except OSError:
        return None
    if not candidates:
        return None
    # refs/main missing (e.g. a download by commit hash): the newest snapshot is the best guess.
    return max(candidates, key=lambda p: (p.stat().st_mtime, p.name))


def _scan_snapshot(snapshot: Path) -> list[_Found]:
    found: list[_Found] = []
    projectors: dict[Path, Path | None] = {}
    for directory, files in _walk(snapshot):
        models, mmproj = _models_in_dir(files)
        projectors[directory] = mmproj
        found.extend(models)
    out: list[_Found] = []
    for f in found:
        # Repos often keep one projector at the root and quants in sub-folders ("Q4_K_M/..."):
        # the nearest projector up the tree belongs to the model.
        mmproj = f.mmproj
        parent = f.path.parent
        while mmproj is None and parent != snapshot and snapshot in parent.parents:
            parent = parent.parent
            mmproj = projectors.get(parent)
        out.append(_Found(f.path, f.size_bytes, mmproj))
    return out


def _safetensors_repo(snapshot: Path) -> int | None:
    """Size of the weights of a safetensors repo at the snapshot's root that modelyard can serve
    (config.json with a known architecture, every weight file present), else None."""
    if repo_kind(snapshot) is None:
        return None
    try:
        weights = [p for p in snapshot.iterdir() if p.name.endswith(".safetensors")]
        # A snapshot links to blobs: a missing blob (download in progress) breaks the link.
        return sum(p.stat().st_size for p in weights) if weights else None
    except OSError:
        return None


def scan_hf_cache(cache_dir: Path) -> list[DiscoveredModel]:
    """Find models in a Hugging Face hub cache (the `refs/main` snapshot of each repo).

    GGUF ids are `org/name:QUANT` when the quantization tag is unique within the repo, else
    `org/name/<path in repo>`; a safetensors repo is `org/name`. Sorted by id.
    """
    cache_dir = Path(cache_dir).expanduser()
    try:
        repo_dirs = sorted(p for p in cache_dir.iterdir() if p.is_dir())
    except OSError:
        return []
    out: list[DiscoveredModel] = []
    for repo_dir in repo_dirs:
        repo = _repo_id(repo_dir.name)
        snapshot = _pick_snapshot(repo_dir) if repo else None
        if repo is None or snapshot is None:
            continue
        weights = _safetensors_repo(snapshot)
        if weights is not None:
            out.append(DiscoveredModel(id=repo, path=snapshot, size_bytes=weights,
                                       format="safetensors", source="hf_cache"))
        found = _scan_snapshot(snapshot)
        tags = [quant_tag_from_filename(f.path.name) for f in found]
        for f, tag in zip(found, tags, strict=True):
            if tag is not None and tags.count(tag) == 1:
                model_id = f"{repo}:{tag}"
            else:
                model_id = f"{repo}/{f.path.relative_to(snapshot).as_posix()}"
            out.append(
                DiscoveredModel(
                    id=model_id,
                    path=f.path,
                    size_bytes=f.size_bytes,
                    source="hf_cache",
                    mmproj=f.mmproj,
                )
            )
    return sorted(out, key=lambda m: m.id)
