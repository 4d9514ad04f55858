"""A local Hugging Face Hub: a real HTTP server process serving repos from plain directories.

    python tests/fakes/fake_hub.py --root DIR [--host H] [--port 0] [flags]

`DIR/<org>/<repo>/<files...>` is the model repo `org/repo`, read afresh on every request. Each
repo has one revision, `main`; its commit sha is the sha1 of the sorted file names and sizes, and
that sha is accepted as a revision too. The fake speaks what `huggingface_hub` 2.4 asks of the Hub,
over plain HTTP (no Xet headers, so the client never tries Xet):

    GET  /api/models                                   list_models: search, author, filter, limit
    GET  /api/models/{org}/{repo}[/revision/{rev}]     model_info/repo_info (?blobs=true: metadata)
    GET  /api/models/{org}/{repo}/tree/{rev}[/{path}]  list_repo_tree/list_repo_files (?recursive)
    HEAD /{org}/{repo}/resolve/{rev}/{path}            the metadata hf_hub_download asks first
    GET  /{org}/{repo}/resolve/{rev}/{path}            the bytes; `Range: bytes=N-` answers 206

Resolve answers carry `X-Repo-Commit`, `ETag` (the quoted sha256 of LFS-like files: *.gguf,
*.safetensors, *.bin, files of 1 MB or more; the git blob sha1 otherwise), for LFS-like files also
`X-Linked-Etag` and `X-Linked-Size`, `Content-Length` and `Accept-Ranges: bytes`. Errors carry
the Hub's `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound) and a JSON {"error": ...}
body, so the client raises its typed errors.

Fault flags: --bytes-per-s N (throttles resolve GET bodies), --die-after-bytes N (os._exit(3)
once N resolve body bytes have gone out, in all, from this process: a server restarted on the same
root and port lets the client resume with `Range: bytes=N-`), --fail-status CODE (resolve GETs
answer CODE; HEADs still succeed), --log FILE (appends one JSON line per request as its answer
starts: method, path, query, range, status). Prints `fake-hub listening on http://HOST:PORT` on
stdout once listening. SIGTERM and SIGINT end the process at once (status 0), even mid-download.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth", ".onnx", ".h5", ".msgpack")
LFS_MIN_SIZE = 1_000_000
CHUNK = 64 * 1024
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def log(*lines: str) -> None:
    sys.stderr.write("".join(line + "\n" for line in lines))
    sys.stderr.flush()


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.") + "000Z"


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    spec = "https://git-lfs.github.com/spec/v1"
    return f"version {spec}\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class Entry:
    path: str  # posix path inside the repo
    file: Path
    size: int
    mtime: float
    lfs: bool


@dataclass
class Repo:
    id: str
    dir: Path
    entries: dict[str, Entry]
    sha: str

    @property
    def last_modified(self) -> float:
        return max((e.mtime for e in self.entries.values()), default=0.0)

    def dirs(self) -> set[str]:
        out: set[str] = set()
        for path in self.entries:
            parts = path.split("/")[:-1]
            out.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        return out


def load_repo(root: Path, org: str, name: str) -> Repo | None:
    if not (NAME.match(org) and NAME.match(name)):
        return None
    top = root / org / name
    if not top.is_dir():
        return None
    entries: dict[str, Entry] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if d != ".git")
        for fname in sorted(filenames):
            file = Path(dirpath) / fname
            try:
                st = file.stat()
            except OSError:
                continue  # a dangling link
            rel = file.relative_to(top).as_posix()
            lfs = fname.endswith(LFS_SUFFIXES) or st.st_size >= LFS_MIN_SIZE
            entries[rel] = Entry(rel, file, st.st_size, st.st_mtime, lfs)
    listing = "".join(f"{p}\0{e.size}\n" for p, e in sorted(entries.items()))
    return Repo(f"{org}/{name}", top, entries, hashlib.sha1(listing.encode()).hexdigest())


class Hashes:
    """Content hashes, computed off the event loop once per (file, size, mtime)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[str, int, float], str] = {}

    async def digest(self, e: Entry) -> str:
        """sha256 of an LFS-like file, the git blob sha1 of any other."""
        key = (str(e.file), e.size, e.mtime)
        if key not in self.cache:
            self.cache[key] = await asyncio.to_thread(self._compute, e)
        return self.cache[key]

    @staticmethod
    def _compute(e: Entry) -> str:
        h = hashlib.sha256() if e.lfs else hashlib.sha1(b"blob %d\0" % e.size)
        with e.file.open("rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        return h.hexdigest()

    async def blob(self, e: Entry) -> dict[str, Any]:
        """The git oid (of the LFS pointer for LFS-like files) and the LFS metadata."""
        digest = await self.digest(e)
        if not e.lfs:
            return {"oid": digest, "lfs": None}
        pointer = lfs_pointer(digest, e.size)
        lfs = {"sha256": digest, "size": e.size, "pointerSize": len(pointer)}
        return {"oid": git_sha1(pointer), "lfs": lfs}


def hub_error(status: int, code: str | None, message: str, commit: str | None = None) -> Response:
    headers = {"X-Error-Message": message}
    if code:
        headers["X-Error-Code"] = code
    if commit:
        headers["X-Repo-Commit"] = commit
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def repo_not_found(repo_id: str) -> Response:
    return hub_error(404, "RepoNotFound", f"Repository Not Found for url: {repo_id}")


def revision_not_found(repo: Repo, rev: str) -> Response:
    return hub_error(404, "RevisionNotFound", f"Invalid rev id: {rev}", repo.sha)


def entry_not_found(repo: Repo, path: str) -> Response:
    return hub_error(404, "EntryNotFound", f"Entry not found: {path}", repo.sha)


def parse_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """(start, end inclusive) of one `bytes=` range; None without one; "bad" if unsatisfiable."""
    if not header:
        return None
    m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header)
    if not m or not (m[1] or m[2]):
        return None  # multi-ranges and other forms: answer the whole file, as servers may
    if not m[1]:
        n = int(m[2])
        return (max(size - n, 0), size - 1) if n and size else "bad"
    start, end = int(m[1]), int(m[2]) if m[2] else size - 1
    if start >= size or end < start:
        return "bad"
    return start, min(end, size - 1)


def safetensors_params(file: Path) -> dict[str, int]:
    """Parameter counts per dtype from a safetensors header; {} when it isn't one."""
    try:
        with file.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                return {}
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error):
        return {}
    counts: dict[str, int] = {}
    for name, t in header.items():
        if name == "__metadata__" or not isinstance(t, dict):
            continue
        count = 1
        for dim in t.get("shape", []):
            count *= int(dim)
        counts[t.get("dtype", "?")] = counts.get(t.get("dtype", "?"), 0) + count
    return counts


class Hub:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.root = Path(opts.root)
        self.hashes = Hashes()
        self.sent = 0  # resolve body bytes sent by this process, for --die-after-bytes
        self.dying = False

    def record(self, request: Request, status: int) -> None:
        if not self.opts.log:
            return
        line = {
            "t": time.time(), "pid": os.getpid(), "method": request.method,
            "path": request.url.path, "query": request.url.query,
            "range": request.headers.get("range"), "status": status,
        }
        with open(self.opts.log, "a") as f:
            f.write(json.dumps(line) + "\n")

    def repo(self, request: Request) -> Repo | Response:
        org, name = request.path_params["org"], request.path_params["repo"]
        return load_repo(self.root, org, name) or repo_not_found(f"{org}/{name}")

    async def info(self, repo: Repo, blobs: bool, full: bool = True) -> dict[str, Any]:
        org = repo.id.split("/")[0]
        names = list(repo.entries)
        tags: list[str] = []
        if any(n.endswith(".gguf") for n in names):
            tags.append("gguf")
        if any(n.endswith(".safetensors") for n in names):
            tags.append("safetensors")
        info: dict[str, Any] = {
            "_id": hashlib.sha1(repo.id.encode()).hexdigest()[:24], "id": repo.id,
            "modelId": repo.id, "author": org, "sha": repo.sha,
            "lastModified": iso(repo.last_modified), "createdAt": iso(repo.last_modified),
            "private": False, "disabled": False, "gated": False, "downloads": 0, "likes": 0,
            "tags": tags, "pipeline_tag": "text-generation",
        }
        config = self.config(repo)
        if config is not None:
            tags.insert(0, "transformers")
            info["library_name"] = "transformers"
            info["config"] = config
        elif "gguf" in tags:
            info["library_name"] = "gguf"
        params: dict[str, int] = {}
        for e in repo.entries.values():
            if e.path.endswith(".safetensors"):
                for dtype, n in safetensors_params(e.file).items():
                    params[dtype] = params.get(dtype, 0) + n
        if params:
            info["safetensors"] = {"parameters": params, "total": sum(params.values())}
        if full:
            siblings = []
            for e in repo.entries.values():
                sibling: dict[str, Any] = {"rfilename": e.path}
                if blobs:
                    blob = await self.hashes.blob(e)
                    sibling.update(size=e.size, blobId=blob["oid"])
                    if blob["lfs"]:
                        sibling["lfs"] = blob["lfs"]
                siblings.append(sibling)
            info["siblings"] = siblings
            info["spaces"] = []
            info["usedStorage"] = sum(e.size for e in repo.entries.values())
        return info

    @staticmethod
    def config(repo: Repo) -> dict[str, Any] | None:
        entry = repo.entries.get("config.json")
        if entry is None:
            return None
        try:
            data = json.loads(entry.file.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {k: data[k] for k in ("architectures", "model_type") if k in data}

    async def tree_entry(self, repo: Repo, path: str, is_dir: bool) -> dict[str, Any]:
        if is_dir:
            oid = hashlib.sha1(f"tree {repo.sha} {path}".encode()).hexdigest()
            return {"type": "directory", "oid": oid, "size": 0, "path": path}
        e = repo.entries[path]
        blob = await self.hashes.blob(e)
        out: dict[str, Any] = {"type": "file", "oid": blob["oid"], "size": e.size, "path": path}
        if blob["lfs"]:
            lfs = blob["lfs"]
            out["lfs"] = {"oid": lfs["sha256"], "size": e.size, "pointerSize": lfs["pointerSize"]}
        return out

    # --- routes -------------------------------------------------------------------------------

    async def list_models(self, request: Request) -> Response:
        q = request.query_params
        search, author = q.get("search", "").lower(), q.get("author")
        wanted = set(q.getlist("filter"))
        limit = int(q["limit"]) if q.get("limit", "").isdigit() else None
        out = []
        orgs = sorted(p for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []
        for org in orgs:
            if author and org.name != author:
                continue
            for top in sorted(p for p in org.iterdir() if p.is_dir()):
                repo = load_repo(self.root, org.name, top.name)
                if repo is None or search not in repo.id.lower():
                    continue
                info = await self.info(repo, blobs=False, full=q.get("full") == "True")
                if wanted <= set(info["tags"]):
                    out.append(info)
        out = out[:limit] if limit is not None else out
        self.record(request, 200)
        return JSONResponse(out)

    async def model_info(self, request: Request) -> Response:
        repo = self.repo(request)
        if isinstance(repo, Repo):
            rev = request.path_params.get("rev", "main")
            if rev not in ("main", repo.sha):
                repo = revision_not_found(repo, rev)
        if not isinstance(repo, Repo):
            self.record(request, repo.status_code)
            return repo
        blobs = request.query_params.get("blobs", "").lower() in ("true", "1")
        self.record(request, 200)
        return JSONResponse(await self.info(repo, blobs))

    async def tree(self, request: Request) -> Response:
        answer = await self._tree(request)
        self.record(request, answer.status_code)
        return answer

    async def _tree(self, request: Request) -> Response:
        repo = self.repo(request)
        if not isinstance(repo, Repo):
            return repo
        rev, base = request.path_params["rev"], request.path_params.get("path", "").strip("/")
        if rev not in ("main", repo.sha):
            return revision_not_found(repo, rev)
        dirs = repo.dirs()
        if base and base not in dirs:
            return entry_not_found(repo, base)
        recursive = request.query_params.get("recursive", "").lower() in ("true", "1")
        prefix = base + "/" if base else ""
        items = [(p, True) for p in dirs] + [(p, False) for p in repo.entries]
        out = []
        for path, is_dir in sorted(items, key=lambda item: (not item[1], item[0])):
            if not path.startswith(prefix):
                continue
            if not recursive and "/" in path[len(prefix):]:
                continue
            out.append(await self.tree_entry(repo, path, is_dir))
        return JSONResponse(out)

    async def resolve(self, request: Request) -> Response:
        answer = await self._resolve(request)
        self.record(request, answer.status_code)
        return answer

    async def _resolve(self, request: Request) -> Response:
        repo = self.repo(request)
        if not isinstance(repo, Repo):
            return repo
        rev, path = request.path_params["rev"], request.path_params["path"]
        if rev not in ("main", repo.sha):
            return revision_not_found(repo, rev)
        entry = repo.entries.get(path)
        if entry is None:
            return entry_not_found(repo, path)
        if request.method == "GET" and self.opts.fail_status:
            code = self.opts.fail_status
            return hub_error(code, None, f"fake-hub: simulated failure {code}", repo.sha)
        digest = await self.hashes.digest(entry)
        headers = {
            "X-Repo-Commit": repo.sha, "ETag": f'"{digest}"', "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "Last-Modified": datetime.fromtimestamp(entry.mtime, UTC).strftime(
                "%a, %d %b %Y %H:%M:%S GMT"),
        }
        if entry.lfs:
            headers.update({"X-Linked-Etag": f'"{digest}"', "X-Linked-Size": str(entry.size)})
        span = parse_range(request.headers.get("range"), entry.size)
        if span == "bad":
            headers["Content-Range"] = f"bytes */{entry.size}"
            return Response(b"", status_code=416, headers=headers)
        start, end = span if isinstance(span, tuple) else (0, entry.size - 1)
        status = 206 if isinstance(span, tuple) else 200
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end}/{entry.size}"
        headers["Content-Length"] = str(end - start + 1)
        if request.method == "HEAD":
            return Response(b"", status_code=status, headers=headers)
        return FileBody(self, entry.file, start, end + 1, status, headers)


class FileBody(Response):
    """A file's bytes [start, stop), throttled and cut short as the fault flags say."""

    def __init__(self, hub: Hub, file: Path, start: int, stop: int, status: int,
                 headers: dict[str, str]) -> None:
        self.hub, self.file, self.start, self.stop = hub, file, start, stop
        self.status_code = status
        self.raw_headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hub, opts = self.hub, self.hub.opts
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        rate = opts.bytes_per_s or 0
        chunk = max(1, min(CHUNK, rate // 20)) if rate else CHUNK
        t0, sent, pos = time.monotonic(), 0, self.start
        with self.file.open("rb") as f:
            f.seek(pos)
            while pos < self.stop:
                if hub.dying:
                    await asyncio.Event().wait()  # another answer is about to end the process
                data = f.read(min(chunk, self.stop - pos))
                if not data:
                    break  # the file shrank under us
                die = opts.die_after_bytes
                if die is not None and hub.sent + len(data) >= die:
                    data = data[: max(die - hub.sent, 0)]
                    hub.dying = True
                pos += len(data)
                sent += len(data)
                hub.sent += len(data)
                await send({"type": "http.response.body", "body": data, "more_body": True})
                if hub.dying:
                    await asyncio.sleep(0.3)  # let the transport hand those bytes to the kernel
                    log(f"fake-hub: dying after {hub.sent} body bytes (--die-after-bytes)")
                    os._exit(3)
                if rate:
                    await asyncio.sleep(max(0.0, t0 + sent / rate - time.monotonic()))
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def build_app(hub: Hub) -> Starlette:
    base = "/api/models/{org}/{repo}"
    routes = [
        Route("/api/models", hub.list_models),
        Route(base, hub.model_info),
        Route(base + "/revision/{rev}", hub.model_info),
        Route(base + "/tree/{rev}", hub.tree),
        Route(base + "/tree/{rev}/{path:path}", hub.tree),
        Route("/{org}/{repo}/resolve/{rev}/{path:path}", hub.resolve, methods=["GET", "HEAD"]),
    ]
    return Starlette(routes=routes)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # ours: end at once, even with a slow download in flight


def _exit_now(signum: int, frame: FrameType | None) -> None:
    os._exit(0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--root", required=True, help="DIR/<org>/<repo>/<files>")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (it is printed)")
    p.add_argument("--bytes-per-s", type=int, default=0, help="throttle resolve GET bodies")
    p.add_argument("--die-after-bytes", type=int, default=None,
                   help="os._exit(3) once this many resolve body bytes have been sent")
    p.add_argument("--fail-status", type=int, default=None, help="resolve GETs answer this")
    p.add_argument("--log", default=None, help="append a JSON line per request here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _exit_now)
    signal.signal(signal.SIGINT, _exit_now)
    family = socket.AF_INET6 if ":" in opts.host else socket.AF_INET
    sock = socket.create_server((opts.host, opts.port), family=family)  # SO_REUSEADDR on POSIX
    port = sock.getsockname()[1]
    host = f"[{opts.host}]" if ":" in opts.host else opts.host
    config = uvicorn.Config(build_app(Hub(opts)), log_level="warning", access_log=False)
    server = _Server(config)
    print(f"fake-hub listening on http://{host}:{port}", flush=True)  # connections queue meanwhile
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
