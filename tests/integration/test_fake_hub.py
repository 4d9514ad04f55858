"""The fake Hub (tests/fakes/fake_hub.py) against the real `huggingface_hub` client.

The client runs in-process with `endpoint=`/`cache_dir=` arguments (its env-derived constants are
read at import), and once in a subprocess configured only by the environment (HF_ENDPOINT...).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from tests.fakes.hub_repos import (
    HubServer,
    fake_gguf,
    gguf_repo,
    read_safetensors_header,
    tiny_safetensors_repo,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

GGUF_REPO, TINY_REPO = "org/smol-GGUF", "org/tiny"
Q4 = "SmolLM2-135M-Instruct-Q4_1.gguf"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(autouse=True)
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # whatever the outer environment says


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "hub"
    gguf_repo(root, GGUF_REPO, fake_gguf(tmp_path / "src.gguf", 3_000_000), mmproj=True)
    tiny_safetensors_repo(root, TINY_REPO)
    return root


@pytest.fixture
def hub(root: Path) -> Iterator[HubServer]:
    with HubServer(root) as server:
        yield server


def download(hub: HubServer, cache: Path, filename: str = Q4, repo: str = GGUF_REPO,
             **kwargs: Any) -> Path:
    return Path(hf_hub_download(repo, filename, endpoint=hub.url, cache_dir=cache, token=False,
                                **kwargs))


def requests_for(hub: HubServer, name: str) -> list[dict[str, Any]]:
    return [r for r in hub.log_lines() if r["path"].endswith("/" + name)]


def test_model_info_lists_files_with_sizes_and_lfs(hub: HubServer, root: Path) -> None:
    api = HfApi(endpoint=hub.url, token=False)
    info = api.model_info(GGUF_REPO, files_metadata=True)
    assert info.id == GGUF_REPO and info.private is False and "gguf" in (info.tags or [])
    assert info.sha is not None and len(info.sha) == 40
    siblings = {s.rfilename: s for s in info.siblings or []}
    names = {Q4, "SmolLM2-135M-Instruct-Q8_0.gguf", "mmproj-SmolLM2-F16.gguf", "README.md"}
    assert set(siblings) == names
    q4 = siblings[Q4]
    assert q4.size == 3_000_000 and q4.lfs is not None
    assert q4.lfs.sha256 == sha256(root / GGUF_REPO / Q4) and q4.lfs.size == 3_000_000
    assert siblings["README.md"].lfs is None and siblings["README.md"].blob_id
    # the commit sha is a revision too; without files_metadata no sizes
    bare = api.model_info(GGUF_REPO, revision=info.sha)
    assert bare.sha == info.sha and all(s.size is None for s in bare.siblings or [])
    assert sorted(api.list_repo_files(TINY_REPO)) == sorted(
        p.name for p in (root / TINY_REPO).iterdir())
    tiny = api.model_info(TINY_REPO)
    assert tiny.safetensors is not None and tiny.safetensors.total > 0
    assert tiny.config == {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    assert [m.id for m in api.list_models(search="smol")] == [GGUF_REPO]


def test_hf_hub_download_puts_exact_bytes_in_cache(hub: HubServer, root: Path,
                                                   tmp_path: Path) -> None:
    cache = tmp_path / "hf" / "hub"
    path = download(hub, cache)
    assert path.is_relative_to(cache) and sha256(path) == sha256(root / GGUF_REPO / Q4)
    assert path.resolve().name == sha256(path)  # the blob is named by the LFS etag
    assert [(r["method"], r["range"], r["status"]) for r in requests_for(hub, Q4)] == [
        ("HEAD", None, 200), ("GET", None, 200)]
    assert download(hub, cache) == path  # cached: a HEAD only
    assert [r["method"] for r in requests_for(hub, Q4)] == ["HEAD", "GET", "HEAD"]


def test_snapshot_download_of_the_safetensors_repo(hub: HubServer, root: Path,
                                                   tmp_path: Path) -> None:
    folder = Path(snapshot_download(TINY_REPO, endpoint=hub.url, cache_dir=tmp_path / "hf",
                                    token=False))
    source = root / TINY_REPO
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in source.iterdir())
    for p in source.iterdir():
        assert (folder / p.name).read_bytes() == p.read_bytes(), p.name
    header = read_safetensors_header(folder / "model.safetensors")
    assert header["model.embed_tokens.weight"] == {
        "dtype": "F16", "shape": [32, 16], "data_offsets": header["model.embed_tokens.weight"][
            "data_offsets"]}
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"


def test_the_client_configured_by_environment_alone(hub: HubServer, tmp_path: Path) -> None:
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1", "HF_HUB_ETAG_TIMEOUT": "5",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "0"}
    env.pop("HF_TOKEN", None)
    script = (
        "import sys; from huggingface_hub import hf_hub_download as d\n"
        f"print(d({GGUF_REPO!r}, {Q4!r}, token=False))"
    )
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=30, check=True)
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path.is_relative_to(tmp_path / "hf" / "hub")
    assert sha256(path) == sha256(hub.root / GGUF_REPO / Q4)


def test_missing_repo_file_and_revision_raise_the_typed_errors(hub: HubServer,
                                                               tmp_path: Path) -> None:
    api, cache = HfApi(endpoint=hub.url, token=False), tmp_path / "hf"
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/nope")
    with pytest.raises(RepositoryNotFoundError):
        download(hub, cache, repo="org/nope")
    with pytest.raises(EntryNotFoundError):
        download(hub, cache, filename="nope.gguf")
    with pytest.raises(RevisionNotFoundError):
        download(hub, cache, revision="v9")
    with pytest.raises(RevisionNotFoundError):
        api.model_info(GGUF_REPO, revision="v9")
    assert {r["status"] for r in hub.log_lines()} == {404}


def test_a_download_resumes_with_range_after_the_server_dies(root: Path, tmp_path: Path) -> None:
    # huggingface_hub 2.4 writes what it received in DOWNLOAD_CHUNK_SIZE (10 MiB) pieces and
    # resumes, within the same call, from the last whole piece: so the file must be larger.
    piece = constants.DOWNLOAD_CHUNK_SIZE
    big = fake_gguf(root / GGUF_REPO / "big.gguf", piece + 1_234_567, seed=2)
    die_after = piece + 500_000
    with HubServer(root, die_after_bytes=die_after) as hub, ThreadPoolExecutor(1) as pool:
        port = hub.port
        pending = pool.submit(download, hub, tmp_path / "hf", filename="big.gguf")
        assert hub.wait_exit(15) == 3  # died mid-file, after die_after body bytes
        hub.restart()  # within the client's retry window (it sleeps 1 s between tries)
        assert hub.port == port
        path = pending.result(timeout=40)
        assert sha256(path) == sha256(big)
    gets = [r for r in requests_for(hub, "big.gguf") if r["method"] == "GET"]
    assert [(r["range"], r["status"]) for r in gets] == [(None, 200), (f"bytes={piece}-", 206)]
    assert gets[0]["pid"] != gets[1]["pid"]


def test_a_failing_get_raises_and_leaves_no_file_in_the_cache(root: Path, tmp_path: Path) -> None:
    cache = tmp_path / "hf"
    with HubServer(root, fail_status=500) as hub:
        with pytest.raises(HfHubHTTPError) as caught:
            download(hub, cache)
        assert caught.value.response.status_code == 500
        assert [(r["method"], r["status"]) for r in requests_for(hub, Q4)] == [
            ("HEAD", 200), ("GET", 500)]
    storage = cache / "models--org--smol-GGUF"
    assert not [p for p in storage.rglob("*") if p.is_file() and p.parent.name != "refs"]


def test_throttled_bodies_arrive_gradually_and_can_be_cancelled(root: Path,
                                                                tmp_path: Path) -> None:
    rate = 1_000_000
    with HubServer(root, bytes_per_s=rate) as hub:
        url = f"{hub.url}/{GGUF_REPO}/resolve/main/{Q4}"
        t0 = time.monotonic()
        with httpx.stream("GET", url, timeout=10) as response:
            assert response.headers["content-length"] == "3000000"
            got = 0
            for chunk in response.iter_bytes():
                got += len(chunk)
                if got >= 200_000:
                    break  # cancel mid-file
        assert 0.1 <= time.monotonic() - t0 < 1.5  # ~0.15 s; the whole file would take 3 s
        assert hub.alive()
        t0 = time.monotonic()
        path = download(hub, tmp_path / "hf", filename="mmproj-SmolLM2-F16.gguf")
        assert path.stat().st_size > 4096
        small = fake_gguf(root / GGUF_REPO / "part.gguf", 400_000, seed=1)
        assert sha256(download(hub, tmp_path / "hf", filename="part.gguf")) == sha256(small)
        assert time.monotonic() - t0 >= 0.3  # 400 KB at 1 MB/s: ~0.35 s


def test_range_requests_and_restart_on_the_same_port(hub: HubServer, root: Path) -> None:
    data = (root / GGUF_REPO / Q4).read_bytes()
    url = f"{hub.url}/{GGUF_REPO}/resolve/main/{Q4}"
    head = httpx.head(url)
    assert head.headers["etag"] == f'"{hashlib.sha256(data).hexdigest()}"'
    assert head.headers["x-linked-size"] == "3000000" and "x-xet-hash" not in head.headers
    part = httpx.get(url, headers={"Range": "bytes=100-199"})
    assert part.status_code == 206 and part.content == data[100:200]
    assert part.headers["content-range"] == "bytes 100-199/3000000"
    assert httpx.get(url, headers={"Range": "bytes=-10"}).content == data[-10:]
    assert httpx.get(url, headers={"Range": "bytes=3000000-"}).status_code == 416
    readme = httpx.head(f"{hub.url}/{GGUF_REPO}/resolve/main/README.md")
    blob = (root / GGUF_REPO / "README.md").read_bytes()
    git_oid = hashlib.sha1(b"blob %d\0" % len(blob) + blob).hexdigest()
    assert readme.headers["etag"] == f'"{git_oid}"' and "x-linked-etag" not in readme.headers
    port, pid = hub.port, hub.pid
    hub.restart()
    assert (hub.port, hub.alive()) == (port, True) and hub.pid != pid
    assert httpx.get(url, headers={"Range": "bytes=0-3"}).content == b"GGUF"
