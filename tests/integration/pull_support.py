"""Helpers for the pull tests: a `modelyard serve` pointed at a fake Hub, and job polling.

`Server` (tests/support.py) copies `os.environ` when it starts its process, so `hub_server`
starts it with the Hub's variables patched into the environment for that moment only
(module-scoped fixtures cannot use `monkeypatch`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
from tests.fakes.hub_repos import HubServer, fake_gguf, gguf_repo
from tests.support import Server

FINAL = ("succeeded", "failed", "cancelled", "interrupted")
ACTIVE = ("queued", "running")
# Variables of the outer environment that would point a pull elsewhere than the fake Hub.
_HF_VARS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
            "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_HOME")


def hub_env(hub: HubServer, hf_home: Path, *, attempts: int = 100,
            retry_s: float = 0.1) -> dict[str, str]:
    """What the server (and so its pull children) needs to download from `hub` into
    `hf_home/hub`; a hub that goes away is retried every `retry_s`, `attempts` times."""
    return {
        "HF_ENDPOINT": hub.url, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
        "MODELYARD_PULL_ATTEMPTS": str(attempts), "MODELYARD_PULL_RETRY_S": str(retry_s),
    }


def start_server(home: Path, cfg: dict[str, Any], env: dict[str, str], *args: str,
                 healthy_timeout_s: float = 60.0) -> Server:
    """A healthy `modelyard serve` whose environment has `env` (the caller stops it)."""
    with mock.patch.dict(os.environ):
        for name in _HF_VARS:
            os.environ.pop(name, None)
        os.environ.update(env)
        server = Server(home, cfg, *args)
    try:
        server.wait_healthy(healthy_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def running_server(home: Path, cfg: dict[str, Any], env: dict[str, str],
                   *args: str) -> Iterator[Server]:
    server = start_server(home, cfg, env, *args)
    try:
        yield server
    finally:
        server.stop()


# ---- HTTP ---------------------------------------------------------------------------------


def post(server: Server, path: str, body: Any = None, timeout: float = 30.0) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.admin_headers, timeout=timeout)


def submit(server: Server, model: str, **fields: Any) -> dict[str, Any]:
    """POST /pull; the 202 answer."""
    r = post(server, "/pull", {"model": model, **fields})
    assert r.status_code == 202, r.text
    body = dict(r.json())
    assert body["status"] == "accepted" and body["job_id"] == body["job"]["id"], body
    return body


def get_job(server: Server, job_id: str) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/jobs/{job_id}", headers=server.admin_headers, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def follow(server: Server, job_id: str, until: tuple[str, ...] = FINAL,
           timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Every look at the job (polled) until its status is in `until`; the last is that one."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while True:
        job = get_job(server, job_id)
        seen.append(job)
        if job["status"] in until:
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} still {job['status']} after {timeout_s} s: {job}")
        time.sleep(0.02)


def wait_job(server: Server, job_id: str, until: tuple[str, ...] = FINAL,
             timeout_s: float = 60.0) -> dict[str, Any]:
    return follow(server, job_id, until, timeout_s)[-1]


def wait_bytes(server: Server, job_id: str, at_least: int,
               timeout_s: float = 30.0) -> dict[str, Any]:
    """The job once it runs and has `at_least` bytes on disk."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = get_job(server, job_id)
        if job["status"] == "running" and (job["bytes_done"] or 0) >= at_least:
            return job
        assert job["status"] in ACTIVE, f"the job ended before {at_least} bytes: {job}"
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} at {job['bytes_done']} bytes after {timeout_s} s")
        time.sleep(0.02)


def openai_ids(server: Server) -> list[str]:
    r = httpx.get(server.url + "/v1/models", headers=server.admin_headers, timeout=10)
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["data"]]


def ollama_names(server: Server) -> list[str]:
    """/api/tags's names as model ids: Ollama lists an untagged name as `name:latest`."""
    r = httpx.get(server.url + "/api/tags", headers=server.admin_headers, timeout=10)
    assert r.status_code == 200, r.text
    return [m["name"].removesuffix(":latest") for m in r.json()["models"]]


def native_models(server: Server) -> dict[str, dict[str, Any]]:
    r = httpx.get(server.url + "/models", headers=server.admin_headers, timeout=10)
    assert r.status_code == 200, r.text
    return {m["model"]: m for m in r.json()["models"]}


def catalog_names(server: Server) -> dict[str, list[str]]:
    """The names each of the three listings shows."""
    return {"openai": openai_ids(server), "ollama": ollama_names(server),
            "native": list(native_models(server))}


# ---- disk ---------------------------------------------------------------------------------


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def repo_cache(hf_home: Path, repo_id: str) -> Path:
    """huggingface_hub's cache folder of a model repo under HF_HOME."""
    return hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))


def snapshot_files(hf_home: Path, repo_id: str) -> dict[str, Path]:
    """name → file in any snapshot of the repo (links resolved by the caller's reads)."""
    found: dict[str, Path] = {}
    for snapshot in sorted((repo_cache(hf_home, repo_id) / "snapshots").glob("*")):
        for f in snapshot.rglob("*"):
            if f.is_file():
                found[f.relative_to(snapshot).as_posix()] = f
    return found


def partials(hf_home: Path) -> list[Path]:
    return sorted((hf_home / "hub").rglob("*.incomplete")) if (hf_home / "hub").exists() else []


def blobs(hf_home: Path, repo_id: str) -> list[Path]:
    where = repo_cache(hf_home, repo_id) / "blobs"
    return sorted(where.iterdir()) if where.is_dir() else []


# ---- the Hub ------------------------------------------------------------------------------


def quant_repo(root: Path, repo_id: str, size: int, quants: tuple[str, ...], *,
               seed: int = 0, stem: str = "Model") -> dict[str, Path]:
    """A GGUF repo whose quants are different files (`{stem}-{quant}.gguf`, seeded random
    bytes after a GGUF header), so none shares a blob with another; name → source file."""
    top = root / repo_id
    out = {}
    for n, quant in enumerate(quants):
        name = f"{stem}-{quant}.gguf"
        out[name] = fake_gguf(top / name, size, seed=seed * 100 + n, name=f"{repo_id} {quant}")
    (top / "README.md").write_text(f"# {repo_id}\n")
    return out


def demo_repo(root: Path, repo_id: str, demo: Path, quants: tuple[str, ...]) -> Path:
    """The real demo GGUF served as `repo_id` (one link per quant)."""
    return gguf_repo(root, repo_id, demo, quants=quants)


def resolve_requests(hub: HubServer, repo_id: str, name: str) -> list[dict[str, Any]]:
    """The hub's logged GETs of one file's bytes (`/{repo}/resolve/{rev}/{name}`)."""
    return [r for r in hub.log_lines()
            if r["method"] == "GET" and r["path"].startswith(f"/{repo_id}/resolve/")
            and r["path"].endswith("/" + name)]


def range_start(request: dict[str, Any]) -> int | None:
    """N of a logged `Range: bytes=N-` request, else None."""
    value = request.get("range")
    if not value or not value.startswith("bytes=") or not value.endswith("-"):
        return None
    return int(value[len("bytes="):-1])
