"""One pull, run as its own process: `python -m modelyard.store.pull REF --quantize auto`.

The front runs every pull job in a child process so that a download can be cancelled at once
(SIGTERM), a front that dies leaves a download that a later resume continues (huggingface_hub
resumes from its `.incomplete` file), and the front's event loop never waits on a socket read
of a multi-GB file. The child speaks JSON lines on stdout:

    {"event": "plan", "format", "quant", "model_id", "bytes_total", "files": [{"name", "size"}]}
    {"event": "file", "name": "…"}                      a file starts
    {"event": "progress", "bytes_done": N, "file": "…", "bytes_fetched": M}  at most a few
                                                         per second; M: downloaded by this run
    {"event": "done", "local_path", "mmproj", "revision", "files"}
    {"event": "error", "code": "…", "status": 4xx/5xx, "message": "…", "available": [...]}

It honours HF_ENDPOINT, HF_TOKEN and HF_HOME, as huggingface_hub does. On an error or a cancel
it removes what it had half-written, so the cache never holds a partial file; only a process
that is killed outright leaves its `.incomplete` file behind, for the resume.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

# Pulls are explicit downloads: no telemetry, and progress goes to our events, not a terminal.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from huggingface_hub import (
    HfApi,
    constants,
    get_hf_file_metadata,
    get_session,
    hf_hub_url,
    hf_raise_for_status,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils._headers import build_hf_headers

from modelyard.store.refs import (
    ModelRef,
    PullPlan,
    UnknownQuant,
    parse_ref,
    plan_pull,
    pulled_model_id,
)

PROGRESS_EVERY_S = 0.25
# While the hub is away, a file is retried (continuing where it stopped) this many times.
FETCH_ATTEMPTS = int(os.environ.get("MODELYARD_PULL_ATTEMPTS", "10"))
FETCH_RETRY_S = float(os.environ.get("MODELYARD_PULL_RETRY_S", "1.0"))
FETCH_TIMEOUT_S = 30.0
_lock = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    with _lock:
        sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
        sys.stdout.flush()


class PullError(Exception):
    def __init__(self, code: str, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code, self.status, self.message, self.extra = code, status, message, extra


class Progress:
    """Bytes of the plan on disk: finished files plus what the current download has."""

    def __init__(self) -> None:
        self.finished = 0
        self.current = 0
        self.fetched = 0  # bytes downloaded by this process (for /metrics)
        self.file = ""
        self._last = 0.0

    def report(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= PROGRESS_EVERY_S:
            self._last = now
            emit("progress", bytes_done=self.finished + self.current, file=self.file,
                 bytes_fetched=self.fetched)


PROGRESS = Progress()


def repo_cache(ref: ModelRef) -> Path:
    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=ref.repo_id, repo_type="model")


def remove_partials(ref: ModelRef) -> None:
    """Nothing half-written stays in the cache after a failure or a cancel."""
    blobs = repo_cache(ref) / "blobs"
    for partial in blobs.glob("*.incomplete"):
        partial.unlink(missing_ok=True)


def _hub_error(exc: Exception, ref: ModelRef) -> PullError:
    if isinstance(exc, GatedRepoError):
        return PullError("repo_gated", 403, f"{ref.repo_id} is gated: accept its terms on the "
                         "hub and set HF_TOKEN")
    if isinstance(exc, RepositoryNotFoundError):
        return PullError("repo_not_found", 404, f"no repository {ref.repo_id} on "
                         f"{constants.ENDPOINT} (or it is private: set HF_TOKEN)")
    if isinstance(exc, RevisionNotFoundError):
        return PullError("revision_not_found", 404,
                         f"{ref.repo_id} has no revision {ref.revision!r}")
    if isinstance(exc, EntryNotFoundError):
        return PullError("file_not_found", 404, f"{ref.repo_id}: {exc}")
    return PullError("hub_error", 502, f"the hub at {constants.ENDPOINT} failed: {exc}")


def _check_space(plan_total: int, already: int, reserve: int) -> None:
    cache = Path(constants.HF_HUB_CACHE)
    probe = cache
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    needed = plan_total - already
    if free - needed < reserve:
        raise PullError(
            "insufficient_storage", 507,
            f"needs {needed / 1e9:.2f} GB in {cache} but only {free / 1e9:.2f} GB is free "
            f"(and {reserve / 1e9:.2f} GB must stay free: reserve_free_bytes)",
        )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _verify(path: Path, size: int | None, sha256: str | None, name: str) -> None:
    """The bytes are the hub's: size, and sha256 for LFS files; a bad file is deleted."""
    real = path.resolve()
    got = real.stat().st_size
    if size is not None and got != size:
        bad = f"{name}: {got} bytes on disk, the hub lists {size}"
    elif sha256 is not None and _sha256(real) != sha256:
        bad = f"{name}: sha256 differs from the hub's"
    else:
        return
    real.unlink(missing_ok=True)  # no corrupt file stays
    raise PullError("verification_failed", 502, bad)


def pull(ref: ModelRef, quantize: str, reserve_free_bytes: int) -> None:
    api = HfApi()
    try:
        info = api.model_info(ref.repo_id, revision=ref.revision, files_metadata=True)
    except (HfHubHTTPError, OSError) as exc:
        raise _hub_error(exc, ref) from exc
    siblings = {s.rfilename: s for s in info.siblings or []}
    try:
        plan = _plan(ref, sorted(siblings), quantize)
    except UnknownQuant as exc:
        raise PullError("unknown_quant", 400, str(exc), available=exc.available) from exc
    except ValueError as exc:
        raise PullError("invalid_reference", 400, str(exc)) from exc

    sizes = {f: siblings[f].size for f in plan.files}
    total = sum(s or 0 for s in sizes.values())
    model_id = pulled_model_id(ref, plan)
    emit("plan", format=plan.format, quant=plan.quant, model_id=model_id, bytes_total=total,
         files=[{"name": f, "size": sizes[f]} for f in plan.files], revision=info.sha)
    cached = sum(sizes[f] or 0 for f in plan.files if _cached(ref, info.sha, f))
    _check_space(total, cached, reserve_free_bytes)

    paths: dict[str, Path] = {}
    for name in plan.files:
        PROGRESS.file, PROGRESS.current = name, 0
        emit("file", name=name)
        lfs = siblings[name].lfs
        paths[name] = download(ref, info.sha or "main", name, sizes[name],
                               lfs.sha256 if lfs else None)
        PROGRESS.finished += sizes[name] or paths[name].stat().st_size
        PROGRESS.current = 0
        PROGRESS.report(force=True)

    if plan.format == "gguf":
        assert plan.model_file is not None
        local_path = paths[plan.model_file]
    else:
        local_path = next(iter(paths.values())).parent  # the snapshot directory
    mmproj = paths[plan.mmproj] if plan.mmproj else None
    emit("done", local_path=str(local_path), mmproj=str(mmproj) if mmproj else None,
         revision=info.sha, files=plan.files, format=plan.format, model_id=model_id)


def _plan(ref: ModelRef, files: list[str], quantize: str) -> PullPlan:
    """The files to fetch. `quantize: fp16` on a GGUF repo with no quant named asks for the
    16-bit file rather than the default 4-bit one."""
    plan = plan_pull(ref, files)
    if quantize == "fp16" and plan.format == "gguf" and ref.quant is None and not ref.filename:
        for wide in ("F16", "BF16"):
            try:
                return plan_pull(ref.with_quant(wide), files)
            except UnknownQuant:
                continue
    return plan


def download(ref: ModelRef, commit: str, name: str, size: int | None,
             sha256: str | None) -> Path:
    """One file into the hub cache (blobs/<etag>, snapshots/<commit>/<name> → the blob), the
    way huggingface_hub lays it out, so its tools and ours see the same cache.

    huggingface_hub itself restarts a file from byte 0 after its process died; this keeps a
    stable `blobs/<etag>.incomplete` and continues it with a Range request, both across retries
    (the hub went away for a moment) and across processes (modelyard was restarted).
    """
    url = hf_hub_url(ref.repo_id, name, revision=commit)
    try:
        meta = get_hf_file_metadata(url)
    except (HfHubHTTPError, OSError) as exc:
        raise _hub_error(exc, ref) from exc
    if meta.etag is None:
        raise PullError("hub_error", 502, f"{name}: the hub sent no ETag")
    cache = repo_cache(ref)
    blob = cache / "blobs" / meta.etag
    link = cache / "snapshots" / (meta.commit_hash or commit) / name
    expected = size if size is not None else meta.size
    if not (blob.exists() and (expected is None or blob.stat().st_size == expected)):
        blob.parent.mkdir(parents=True, exist_ok=True)
        partial = blob.with_name(blob.name + ".incomplete")
        _fetch(meta.location, partial, expected, name)
        _verify(partial, expected, sha256, name)
        os.replace(partial, blob)
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        link.symlink_to(os.path.relpath(blob, link.parent))
    refs = cache / "refs" / (ref.revision or "main")
    if not (ref.revision and ref.revision == meta.commit_hash):
        refs.parent.mkdir(parents=True, exist_ok=True)
        refs.write_text(meta.commit_hash or commit)
    return link


def _fetch(url: str, partial: Path, size: int | None, name: str) -> None:
    """GET `url` into `partial`, continuing what it holds; retried while the hub is away."""
    session = get_session()
    for attempt in range(1, FETCH_ATTEMPTS + 1):
        have = partial.stat().st_size if partial.exists() else 0
        if size is not None and have >= size:
            return
        headers = build_hf_headers()
        if have:
            headers["Range"] = f"bytes={have}-"
        try:
            with session.stream("GET", url, headers=headers, follow_redirects=True,
                                timeout=FETCH_TIMEOUT_S) as r:
                if r.status_code == 416 and have:
                    partial.unlink()  # what we hold does not fit this file: start again
                    continue
                if r.status_code >= 400:
                    r.read()
                    hf_raise_for_status(r)
                resumed = r.status_code == 206
                with partial.open("ab" if resumed else "wb") as f:
                    PROGRESS.current = have if resumed else 0
                    for chunk in r.iter_bytes(1 << 20):
                        f.write(chunk)
                        PROGRESS.current += len(chunk)
                        PROGRESS.fetched += len(chunk)
                        PROGRESS.report()
            return
        except HfHubHTTPError as exc:
            raise PullError("hub_error", 502, f"download of {name} failed: {exc}") from exc
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise PullError("insufficient_storage", 507, f"disk full: {exc}") from exc
            failure: Exception = exc
        except Exception as exc:  # httpx2's transport errors (the hub went away mid-file)
            failure = exc
        emit("retry", file=name, attempt=attempt, error=f"{type(failure).__name__}: {failure}")
        time.sleep(FETCH_RETRY_S)
    raise PullError("hub_unreachable", 502,
                    f"download of {name} failed {FETCH_ATTEMPTS} times: {failure}")


def _cached(ref: ModelRef, revision: str | None, name: str) -> bool:
    if revision is None:
        return False
    return (repo_cache(ref) / "snapshots" / revision / name).exists()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Pull one model from a Hugging Face hub.")
    p.add_argument("ref")
    p.add_argument("--quantize", default="auto", choices=["auto", "q4", "fp16", "no"])
    p.add_argument("--reserve-free-bytes", type=int, default=1 << 30)
    args = p.parse_args(argv)
    try:
        ref = parse_ref(args.ref)
    except ValueError as exc:
        emit("error", code="invalid_reference", status=400, message=str(exc))
        return 2

    def cancelled(signum: int, frame: FrameType | None) -> None:
        remove_partials(ref)
        emit("error", code="cancelled", status=499, message="the pull was cancelled")
        os._exit(143)

    signal.signal(signal.SIGTERM, cancelled)
    try:
        pull(ref, args.quantize, args.reserve_free_bytes)
    except PullError as exc:
        remove_partials(ref)
        emit("error", code=exc.code, status=exc.status, message=exc.message, **exc.extra)
        return 1
    except Exception as exc:  # report anything, in the protocol, rather than a traceback
        remove_partials(ref)
        emit("error", code="pull_failed", status=500, message=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
