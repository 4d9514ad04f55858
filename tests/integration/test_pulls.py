"""Pull jobs end to end: real `modelyard serve` processes downloading from the fake Hub
(tests/fakes/fake_hub.py, a real HTTP server process) into a real HF cache, through the native
job API, Ollama's /api/pull and the CLI; cancel, resume after the Hub or modelyard went away,
errors, disk reserve, concurrency, explicit downloads, delete/copy and import.

Servers:
  * `fast`: a Hub at 12 MB/s, `model_dirs` for the import/rescan test; most tests share it.
  * `slow`: a Hub at 3 MB/s, `max_concurrent_pulls: 1` (cancel, queueing, and — restarting its
    Hub on the same port with other flags — the Hub dying mid-file).
  * one-off servers for a modelyard restart, the disk reserve, and the two tests that chat with
    the real llama-server and the real demo model (also marked e2e).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.fakes.hub_repos import HubServer, fake_gguf, gguf_repo
from tests.integration.harness import HELLO, config
from tests.integration.pull_support import (
    blobs,
    catalog_names,
    demo_repo,
    follow,
    get_job,
    hub_env,
    native_models,
    ollama_names,
    openai_ids,
    partials,
    post,
    quant_repo,
    range_start,
    resolve_requests,
    running_server,
    sha256,
    snapshot_files,
    start_server,
    submit,
    wait_bytes,
    wait_job,
)
from tests.support import Server, fake_model, poll, require_e2e_artifact

from modelyard.config import DEMO_MODEL_FILE, Settings, cache_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MB = 1_000_000
SIZE = 12 * MB  # every fake GGUF the Hub serves for a real download
FAST_BPS = 12 * MB  # about one second per file: progress is seen moving
SLOW_BPS = 3 * MB  # a file takes ~4 s: time to cancel, queue or stop modelyard mid-way
SMOL = "SmolLM2-135M-Instruct"
RACE_PULLS = 6  # each is missed with p ~ 0.75-0.9: all six seen in time by luck ~ 1e-4


# ---- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake repos (quants are distinct files, so no two share a blob)."""
    root = tmp_path_factory.mktemp("hub") / "repos"
    quant_repo(root, "org/smol-GGUF", SIZE, ("Q4_1", "Q8_0"), seed=1, stem=SMOL)
    quant_repo(root, "org/stream-GGUF", SIZE, ("Q4_K_M",), seed=2)
    quant_repo(root, "org/nostream-GGUF", 2 * MB, ("Q4_0",), seed=3)
    quant_repo(root, "org/share-GGUF", SIZE, ("Q4_0",), seed=4)
    quant_repo(root, "org/cancel-GGUF", SIZE, ("Q4_0",), seed=5)
    quant_repo(root, "org/first-GGUF", SIZE, ("Q4_0",), seed=6)
    quant_repo(root, "org/second-GGUF", SIZE, ("Q4_0",), seed=7)
    quant_repo(root, "org/resume-GGUF", SIZE, ("Q4_0",), seed=8)
    quant_repo(root, "org/restart-GGUF", SIZE, ("Q4_0",), seed=9)
    quant_repo(root, "org/done-GGUF", 1 * MB, ("Q4_0",), seed=10)
    quant_repo(root, "org/full-GGUF", SIZE, ("Q4_0",), seed=11)
    quant_repo(root, "org/keep-GGUF", 1 * MB, ("Q4_0",), seed=13)
    for n in range(RACE_PULLS):
        quant_repo(root, f"org/tiny{n}-GGUF", 100_000, ("Q4_0",), seed=40 + n)
    # Two quants with the same bytes: in the HF cache they are two links to one blob.
    twin = fake_gguf(root.parent / "twin.gguf", 1 * MB, seed=12)
    for repo in ("org/twin-GGUF", "org/twin2-GGUF"):
        gguf_repo(root, repo, twin, quants=("Q4_0", "Q5_0"))
    return root


def _hub(root: Path, log: Path, **flags: Any) -> Iterator[HubServer]:
    with HubServer(root, log=log, **flags) as hub:
        yield hub


@pytest.fixture(scope="module")
def fast_hub(hub_root: Path) -> Iterator[HubServer]:
    yield from _hub(hub_root, hub_root.parent / "fast.jsonl", bytes_per_s=FAST_BPS)


@pytest.fixture(scope="module")
def slow_hub(hub_root: Path) -> Iterator[HubServer]:
    yield from _hub(hub_root, hub_root.parent / "slow.jsonl", bytes_per_s=SLOW_BPS)


@pytest.fixture(scope="module")
def auto_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `model_dirs` directory: its models are `auto` (they come and go with their files)."""
    where = tmp_path_factory.mktemp("auto-models")
    fake_gguf(where / "auto-one-Q4_0.gguf", 300_000, seed=20)
    fake_gguf(where / "auto-two-Q4_0.gguf", 300_000, seed=21)
    return where


@pytest.fixture(scope="module")
def fast(tmp_path_factory: pytest.TempPathFactory, fast_hub: HubServer,
         auto_dir: Path) -> Iterator[tuple[Server, Path]]:
    """(server, HF_HOME) downloading from the fast Hub."""
    base = tmp_path_factory.mktemp("fast")
    hf_home = base / "hf"
    # A preset of a model not pulled yet: listed once it is (test_deleting_a_config_preset…).
    cfg = config(model_dirs=[str(auto_dir)],
                 presets=[{"id": "keeper", "model": "org/keep-gguf:q4_0",
                           "system": "Be brief."}])
    with running_server(base / "home", cfg, hub_env(fast_hub, hf_home)) as server:
        yield server, hf_home


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory,
         slow_hub: HubServer) -> Iterator[tuple[Server, Path]]:
    base = tmp_path_factory.mktemp("slow")
    hf_home = base / "hf"
    with running_server(base / "home", config(max_concurrent_pulls=1),
                        hub_env(slow_hub, hf_home)) as server:
        yield server, hf_home


def demo_gguf() -> Path:
    """The real demo model (`make demo-model`), or a skip/fail as tests/support.py decides."""
    for where in (cache_dir() / "models", Path.home() / ".modelyard" / "models"):
        if (where / DEMO_MODEL_FILE).is_file():
            return where / DEMO_MODEL_FILE
    return require_e2e_artifact(None, "the demo model")


@pytest.fixture(scope="module")
def demo_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    """The real demo GGUF served (unthrottled) as org/smol-GGUF, quants Q4_1 and Q8_0."""
    require_e2e_artifact(Settings().resolve_llama_server(), "llama-server")
    demo = demo_gguf()
    root = tmp_path_factory.mktemp("demo-hub") / "repos"
    demo_repo(root, "org/smol-GGUF", demo, ("Q4_1", "Q8_0"))
    yield from _hub(root, root.parent / "demo.jsonl")


def chat(server: Server, model: str, api: str = "openai", *, timeout: float = 120.0,
         max_tokens: int = 12) -> httpx.Response:
    """A greedy chat: callers assert that the real model's answer has text, which a sampled
    answer that ends at once would not."""
    greedy = {"temperature": 0, "seed": 7}
    if api == "openai":
        path, body = "/v1/chat/completions", {"model": model, "messages": HELLO,
                                              "max_tokens": max_tokens, **greedy}
    elif api == "ollama":
        path, body = "/api/chat", {"model": model, "messages": HELLO, "stream": False,
                                   "options": {"num_predict": max_tokens, **greedy}}
    else:
        path, body = "/chat", {"model": model, "messages": HELLO, "max_tokens": max_tokens,
                               **greedy}
    return httpx.post(server.url + path, json=body, headers=server.admin_headers, timeout=timeout)


def _listed(server: Server, name: str) -> dict[str, bool]:
    return {api: name in names for api, names in catalog_names(server).items()}


# ---- 1. a pull with progress ----------------------------------------------------------------


def test_pull_reports_progress_and_lands_byte_identical_in_the_hf_cache(
    fast: tuple[Server, Path], hub_root: Path
) -> None:
    server, hf_home = fast
    name = f"{SMOL}-Q4_1.gguf"
    accepted = submit(server, "org/smol-GGUF:Q4_1")
    assert accepted["created"] is True
    assert accepted["job"]["status"] in ("queued", "running")
    assert accepted["job"]["ref"] and accepted["job"]["model"] == "org/smol-GGUF:Q4_1"

    seen = follow(server, accepted["job_id"])
    job = seen[-1]
    assert job["status"] == "succeeded", job
    statuses = [j["status"] for j in seen]
    assert set(statuses) <= {"queued", "running", "succeeded"}
    assert "running" in statuses
    # queued/running, then succeeded, never back
    order = {"queued": 0, "running": 1, "succeeded": 2}
    assert [order[s] for s in statuses] == sorted(order[s] for s in statuses)

    running = [j for j in seen if j["status"] == "running"]
    done = [j["bytes_done"] or 0 for j in running]
    assert done == sorted(done), f"bytes_done went backwards: {done}"
    moving = sorted({d for d in done if 0 < d < SIZE})
    assert len(moving) >= 2, f"no progress seen between 0 and {SIZE}: {done}"
    assert all(j["bytes_total"] == SIZE for j in running if j["bytes_total"]), running[-1]
    assert name in {j["current_file"] for j in running}

    assert job["bytes_done"] == job["bytes_total"] == SIZE
    assert job["model_id"] == "org/smol-gguf:q4_1"
    assert job["format"] == "gguf"
    assert job["error"] is None and job["error_code"] is None
    assert job["started_at"] >= job["created_at"] and job["finished_at"] >= job["started_at"]
    assert job["local_path"].endswith("/" + name)

    # Listed by all three APIs the moment the job says succeeded.
    everywhere = {"openai": True, "ollama": True, "native": True}
    assert _listed(server, "org/smol-gguf:q4_1") == everywhere
    native = native_models(server)["org/smol-gguf:q4_1"]
    assert native["source"] == "pulled" and native["origin"] == "manual"
    assert native["format"] == "gguf" and native["backend"] == "llamacpp"
    assert native["local_path"] == job["local_path"]
    assert native["size_bytes"] == SIZE

    # Only the quant asked for, byte-identical, in huggingface_hub's layout; nothing partial.
    files = snapshot_files(hf_home, "org/smol-GGUF")
    assert set(files) == {name}
    assert files[name].is_symlink()
    assert sha256(files[name]) == sha256(hub_root / "org/smol-GGUF" / name)
    assert Path(job["local_path"]).resolve() == files[name].resolve()
    assert partials(hf_home) == []

    listed = httpx.get(server.url + "/jobs",
                       headers=server.admin_headers, timeout=10).json()["jobs"]
    assert accepted["job_id"] in [j["id"] for j in listed]




def test_a_succeeded_job_s_model_is_already_in_the_catalog(fast: tuple[Server, Path]) -> None:
    server, _ = fast
    missed = []
    with httpx.Client(timeout=10, headers=server.admin_headers) as client:
        for n in range(RACE_PULLS):
            job_id = submit(server, f"org/tiny{n}-GGUF:Q4_0")["job_id"]
            while (job := client.get(f"{server.url}/jobs/{job_id}").json())["status"] in (
                "queued", "running"
            ):
                pass  # no sleep: what a client following the job closely sees
            assert job["status"] == "succeeded", job
            ids = [m["id"] for m in client.get(server.url + "/v1/models").json()["data"]]
            if job["model_id"] not in ids:
                missed.append(job["model_id"])
    assert missed == [], f"succeeded but not (yet) in /v1/models: {missed}"


# ---- 2. Ollama's /api/pull ------------------------------------------------------------------


def test_ollama_pull_streams_ndjson_progress_then_success(
    fast: tuple[Server, Path], hub_root: Path
) -> None:
    server, hf_home = fast
    name = "Model-Q4_K_M.gguf"
    with httpx.stream("POST", server.url + "/api/pull",
                      json={"model": "hf.co/org/stream-GGUF:Q4_K_M"},
                      headers=server.admin_headers, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line.strip()]

    assert lines[0] == {"status": "pulling manifest"}
    assert lines[-1] == {"status": "success"}
    assert not any("error" in line for line in lines), lines
    pulling = [line for line in lines if line["status"] == f"pulling {name}"]
    assert len(pulling) >= 2, lines
    for line in pulling:
        assert line["digest"].startswith("sha256:") and len(line["digest"]) == 71
        assert line["total"] == SIZE
        assert 0 <= line["completed"] <= SIZE
    completed = [line["completed"] for line in pulling]
    assert completed == sorted(completed), completed
    assert len(set(completed)) >= 2, completed
    statuses = [line["status"] for line in lines]
    assert statuses.index("pulling manifest") < statuses.index(f"pulling {name}")

    # After "success" the model is there, under its id, with the Hub's bytes.
    assert "org/stream-gguf:q4_k_m" in ollama_names(server)
    files = snapshot_files(hf_home, "org/stream-GGUF")
    assert sha256(files[name]) == sha256(hub_root / "org/stream-GGUF" / name)


def test_ollama_pull_without_stream_answers_once(fast: tuple[Server, Path]) -> None:
    server, _ = fast
    r = post(server, "/api/pull", {"model": "org/nostream-GGUF:Q4_0", "stream": False},
             timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "success"}
    assert "org/nostream-gguf:q4_0" in ollama_names(server)
    assert "org/nostream-gguf:q4_0" in openai_ids(server)


def test_ollama_pull_of_an_unknown_repo_is_an_error(fast: tuple[Server, Path]) -> None:
    server, _ = fast
    r = post(server, "/api/pull", {"model": "org/no-such-repo", "stream": False}, timeout=60)
    assert r.status_code == 404, r.text
    body = r.json()
    assert set(body) == {"error"} and "org/no-such-repo" in body["error"]

    with httpx.stream("POST", server.url + "/api/pull",
                      json={"name": "org/no-such-repo-either"},
                      headers=server.admin_headers, timeout=60) as r:
        assert r.status_code == 200  # the stream had begun: the error is in-band
        lines = [json.loads(line) for line in r.iter_lines() if line.strip()]
    assert lines[0] == {"status": "pulling manifest"}
    assert set(lines[-1]) == {"error"} and "org/no-such-repo-either" in lines[-1]["error"]
    assert {"status": "success"} not in lines


# ---- 6. errors ------------------------------------------------------------------------------


def test_unknown_repo_fails_the_job_with_repo_not_found(fast: tuple[Server, Path]) -> None:
    server, hf_home = fast
    job = wait_job(server, submit(server, "org/missing-repo")["job_id"])
    assert job["status"] == "failed", job
    assert job["error_code"] == "repo_not_found"
    assert "org/missing-repo" in job["error"]
    assert not (hf_home / "hub" / "models--org--missing-repo" / "blobs").exists()
    assert "org/missing-repo" not in openai_ids(server)


def test_unknown_quant_fails_and_lists_the_available_ones(fast: tuple[Server, Path]) -> None:
    server, _ = fast
    job = wait_job(server, submit(server, "org/smol-GGUF:Q2_K")["job_id"])
    assert job["status"] == "failed", job
    assert job["error_code"] == "unknown_quant"
    assert "Q2_K" in job["error"]
    assert "Q4_1" in job["error"] and "Q8_0" in job["error"]
    assert "org/smol-gguf:q2_k" not in openai_ids(server)


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "nope"}, "model"),
    ({"model": "org/smol-GGUF", "quantize": "q3"}, "quantize"),
    ({"model": ""}, "model"),
    ({"quantize": "auto"}, "model"),
])
def test_bad_pull_requests_are_400_at_once(fast: tuple[Server, Path], body: dict[str, Any],
                                           param: str) -> None:
    server, _ = fast
    before = len(httpx.get(server.url + "/jobs",
                           headers=server.admin_headers, timeout=10).json()["jobs"])
    r = post(server, "/pull", body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["error"] == "invalid_request"
    assert err.get("param") == param, err
    assert err["message"]
    assert len(httpx.get(server.url + "/jobs",
                         headers=server.admin_headers, timeout=10).json()["jobs"]) == before


def test_unknown_job_is_404(fast: tuple[Server, Path]) -> None:
    server, _ = fast
    r = httpx.get(server.url + "/jobs/0123456789abcdef", headers=server.admin_headers, timeout=10)
    assert r.status_code == 404 and r.json()["error"] == "job_not_found"


# ---- 8a. one job per reference --------------------------------------------------------------


def test_two_pulls_of_the_same_ref_share_one_job(fast: tuple[Server, Path]) -> None:
    server, _ = fast
    first = submit(server, "org/share-GGUF:Q4_0")
    second = submit(server, "org/share-GGUF:q4_0")  # the same reference, in another case
    assert first["created"] is True and second["created"] is False
    assert second["job_id"] == first["job_id"]
    job = wait_job(server, first["job_id"])
    assert job["status"] == "succeeded", job
    ids = [j["id"] for j in httpx.get(server.url + "/jobs",
                                      headers=server.admin_headers, timeout=10).json()["jobs"]
           if j["model_id"] == "org/share-gguf:q4_0"]
    assert ids == [first["job_id"]]
    # Once it is over, a new pull of that reference is a new job (nothing to download).
    again = submit(server, "org/share-GGUF:Q4_0")
    assert again["created"] is True and again["job_id"] != first["job_id"]
    assert wait_job(server, again["job_id"])["status"] == "succeeded"


# ---- 10b. two pulled quants with the same bytes (one blob, two links) ------------------------



def _pull_twins(server: Server, repo: str) -> None:
    for quant in ("Q4_0", "Q5_0"):
        job = wait_job(server, submit(server, f"{repo}:{quant}")["job_id"])
        assert job["status"] == "succeeded", job
    assert post(server, "/admin/rescan").status_code == 200  # the catalog is up to date now


def test_two_pulled_quants_with_the_same_bytes_are_both_listed(
    fast: tuple[Server, Path]
) -> None:
    server, hf_home = fast
    _pull_twins(server, "org/twin-GGUF")
    files = snapshot_files(hf_home, "org/twin-GGUF")
    assert files[f"{SMOL}-Q4_0.gguf"].resolve() == files[f"{SMOL}-Q5_0.gguf"].resolve()
    ids = openai_ids(server)
    assert "org/twin-gguf:q4_0" in ids
    assert "org/twin-gguf:q5_0" in ids


def test_deleting_a_pulled_quant_keeps_a_blob_another_pulled_quant_links_to(
    fast: tuple[Server, Path], hub_root: Path
) -> None:
    server, hf_home = fast
    _pull_twins(server, "org/twin2-GGUF")
    files = snapshot_files(hf_home, "org/twin2-GGUF")
    q4, q5 = files[f"{SMOL}-Q4_0.gguf"], files[f"{SMOL}-Q5_0.gguf"]
    assert q4.resolve() == q5.resolve()

    r = httpx.delete(server.url + "/models/org/twin2-gguf:q4_0",
                     headers=server.admin_headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json() == {"model": "org/twin2-gguf:q4_0", "status": "deleted"}
    assert not q4.is_symlink()
    assert "org/twin2-gguf:q4_0" not in openai_ids(server)
    assert q5.is_file(), "the other pulled quant's link now dangles"
    assert sha256(q5) == sha256(hub_root / "org/twin2-GGUF" / f"{SMOL}-Q5_0.gguf")


def test_deleting_a_config_preset_never_deletes_the_pulled_model_it_runs(
    fast: tuple[Server, Path]
) -> None:
    server, hf_home = fast
    job = wait_job(server, submit(server, "org/keep-GGUF:Q4_0")["job_id"])
    assert job["status"] == "succeeded", job
    assert post(server, "/admin/rescan").status_code == 200
    assert "keeper" in openai_ids(server)
    (pulled,) = snapshot_files(hf_home, "org/keep-GGUF").values()
    for attempt in (post(server, "/api/delete", {"model": "keeper"}),
                    httpx.delete(server.url + "/models/keeper", headers=server.admin_headers,
                                 timeout=30)):
        assert attempt.status_code == 400, attempt.text
        assert "preset" in attempt.text
    assert pulled.is_file()  # the preset's model and its files are still there
    assert {"keeper", "org/keep-gguf:q4_0"} <= set(openai_ids(server))


# ---- 9a. explicit downloads only ------------------------------------------------------------


@pytest.mark.parametrize("api", ["openai", "ollama", "native"])
def test_chat_with_a_model_not_pulled_is_404_saying_how_to_pull_it(
    fast: tuple[Server, Path], api: str
) -> None:
    server, hf_home = fast
    r = chat(server, "org/not-here", api, timeout=30)
    assert r.status_code == 404, r.text
    body = r.json()
    if api == "openai":
        code, message = body["error"]["code"], body["error"]["message"]
    elif api == "ollama":
        code, message = None, body["error"]
    else:
        code, message = body["error"], body["message"]
    assert code in (None, "model_not_pulled")
    assert "modelyard pull org/not-here" in message
    assert not (hf_home / "hub" / "models--org--not-here").exists()
    jobs = httpx.get(server.url + "/jobs", headers=server.admin_headers, timeout=10).json()["jobs"]
    assert not [j for j in jobs if j["model"] == "org/not-here"]


# ---- 11. import and rescan ------------------------------------------------------------------


def test_import_attaches_the_best_projector_is_idempotent_and_survives_a_rescan(
    fast: tuple[Server, Path], tmp_path: Path, auto_dir: Path
) -> None:
    server, _ = fast
    tree = tmp_path / "imports"
    vision = tree / "vision" / "deeper"
    fake_gguf(vision / "alpha-Q4_0.gguf", 200_000, seed=30)
    fake_gguf(vision / "beta-Q8_0.gguf", 200_000, seed=31)
    fake_gguf(vision / "mmproj-F16.gguf", 50_000, seed=32, architecture="clip")
    fake_gguf(vision / "mmproj-BF16.gguf", 50_000, seed=33, architecture="clip")
    (tree / "notes.txt").write_text("not a model")

    before = native_models(server)
    assert before["auto-one-q4_0"]["origin"] == "auto"
    assert before["auto-two-q4_0"]["origin"] == "auto"

    r = post(server, "/admin/import", {"path": str(tree)})
    assert r.status_code == 200, r.text
    imported = r.json()["imported"]
    assert sorted(imported) == ["alpha-q4_0", "beta-q8_0"]

    models = native_models(server)
    for model_id, file in (("alpha-q4_0", "alpha-Q4_0.gguf"), ("beta-q8_0", "beta-Q8_0.gguf")):
        m = models[model_id]
        assert m["source"] == "imported" and m["origin"] == "manual"
        assert m["local_path"] == str(vision / file)
        assert m["mmproj"] == str(vision / "mmproj-BF16.gguf")
        assert model_id in openai_ids(server) and model_id in ollama_names(server)
    names = set(models)
    assert not any("mmproj" in n for n in names), names

    again = post(server, "/admin/import", {"path": str(tree)})
    assert again.status_code == 200 and again.json()["imported"] == []
    assert set(native_models(server)) == names

    # A file gone from a model_dirs directory: a rescan drops that auto model, keeps the rest.
    (auto_dir / "auto-one-Q4_0.gguf").unlink()
    r = post(server, "/admin/rescan")
    assert r.status_code == 200, r.text
    rescanned = {m["model"]: m for m in r.json()["models"]}
    assert "auto-one-q4_0" not in rescanned
    assert rescanned["auto-two-q4_0"]["origin"] == "auto"
    assert rescanned["alpha-q4_0"]["source"] == "imported"
    assert rescanned["beta-q8_0"]["source"] == "imported"
    after = native_models(server)
    assert "auto-one-q4_0" not in after and "auto-one-q4_0" not in openai_ids(server)
    assert after["alpha-q4_0"]["mmproj"] == str(vision / "mmproj-BF16.gguf")

    bad = post(server, "/admin/import", {"path": str(tmp_path / "no-such-dir")})
    assert bad.status_code == 400 and bad.json()["error"] == "invalid_request"


# A NUL, a name too long (ENAMETOOLONG), a `~user` with no such user: refused by the system, so
# refused as the client's mistake too (these were 500s, found by the fuzz tier).
@pytest.mark.parametrize("path", ["/" + "x" * 300 + "/models", "/tmp/a\x00b", "~no-such-user-9/m"])
def test_import_of_a_path_the_system_refuses_is_400(fast: tuple[Server, Path], path: str) -> None:
    server, _ = fast
    r = post(server, "/admin/import", {"path": path})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == "invalid_request" and r.json()["param"] == "path"


# ---- 3. cancel ------------------------------------------------------------------------------


def test_cancel_stops_the_download_and_leaves_nothing(slow: tuple[Server, Path]) -> None:
    server, hf_home = slow
    job_id = submit(server, "org/cancel-GGUF:Q4_0")["job_id"]
    wait_bytes(server, job_id, 2 * MB)
    assert partials(hf_home), "a running download writes its .incomplete file"

    r = httpx.delete(f"{server.url}/jobs/{job_id}", headers=server.admin_headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "cancelled"
    job = get_job(server, job_id)
    assert job["status"] == "cancelled" and job["error_code"] == "cancelled"
    assert job["finished_at"] is not None
    assert partials(hf_home) == []
    assert blobs(hf_home, "org/cancel-GGUF") == []
    assert snapshot_files(hf_home, "org/cancel-GGUF") == {}
    assert _listed(server, "org/cancel-gguf:q4_0") == {"openai": False, "ollama": False,
                                                       "native": False}
    # Cancelling again changes nothing.
    again = httpx.delete(f"{server.url}/jobs/{job_id}", headers=server.admin_headers, timeout=30)
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


# ---- 8b. max_concurrent_pulls ---------------------------------------------------------------


def test_pulls_beyond_max_concurrent_pulls_wait_in_the_queue(slow: tuple[Server, Path]) -> None:
    server, hf_home = slow  # max_concurrent_pulls: 1
    first = submit(server, "org/first-GGUF:Q4_0")["job_id"]
    wait_bytes(server, first, 1)
    second = submit(server, "org/second-GGUF:Q4_0")
    assert second["created"] is True and second["job"]["status"] == "queued"
    wait_bytes(server, first, 2 * MB)
    waiting = get_job(server, second["job_id"])
    assert waiting["status"] == "queued", waiting
    assert waiting["started_at"] is None and not waiting["bytes_done"]
    assert get_job(server, first)["status"] == "running"

    # Its slot freed, the queued one starts.
    assert httpx.delete(f"{server.url}/jobs/{first}",
                        headers=server.admin_headers, timeout=30).json()["status"] == "cancelled"
    wait_bytes(server, second["job_id"], 1)
    assert httpx.delete(f"{server.url}/jobs/{second['job_id']}",
                        headers=server.admin_headers, timeout=30).json()["status"] == "cancelled"
    assert partials(hf_home) == []


# ---- 4. the Hub goes away mid-file ----------------------------------------------------------


def test_download_resumes_with_a_range_request_after_the_hub_comes_back(
    slow: tuple[Server, Path], slow_hub: HubServer, hub_root: Path
) -> None:
    server, hf_home = slow
    name = "Model-Q4_0.gguf"
    cut = 5 * MB
    port = slow_hub.port
    slow_hub.restart(die_after_bytes=cut)  # same port: the server's HF_ENDPOINT still holds
    try:
        assert slow_hub.port == port
        job_id = submit(server, "org/resume-GGUF:Q4_0")["job_id"]
        assert slow_hub.wait_exit(30) == 3  # it died after `cut` body bytes
        during = get_job(server, job_id)
        assert during["status"] == "running", during  # retrying, not failed
        slow_hub.restart()
        assert slow_hub.port == port
        job = wait_job(server, job_id)
    finally:
        slow_hub.restart(bytes_per_s=SLOW_BPS)
    assert job["status"] == "succeeded", job
    assert job["bytes_done"] == job["bytes_total"] == SIZE

    gets = resolve_requests(slow_hub, "org/resume-GGUF", name)
    assert gets[0]["range"] is None
    starts = [range_start(g) for g in gets[1:]]
    resumed = [n for n in starts if n]
    assert resumed, f"no `Range: bytes=N-` request after the cut: {gets}"
    assert all(0 < n <= cut for n in resumed), resumed
    assert any(g["status"] == 206 for g in gets), gets

    files = snapshot_files(hf_home, "org/resume-GGUF")
    assert sha256(files[name]) == sha256(hub_root / "org/resume-GGUF" / name)
    assert partials(hf_home) == []


# ---- 5. modelyard restarts mid-download -----------------------------------------------------


def test_a_pull_interrupted_by_a_restart_is_listed_and_resumes_with_a_range_request(
    tmp_path: Path, hub_root: Path
) -> None:
    home, hf_home = tmp_path / "home", tmp_path / "hf"
    name = "Model-Q4_0.gguf"
    cfg = config()
    with HubServer(hub_root, log=tmp_path / "hub.jsonl", bytes_per_s=SLOW_BPS) as hub:
        server = start_server(home, cfg, hub_env(hub, hf_home))
        try:
            done = submit(server, "org/done-GGUF:Q4_0")["job_id"]
            assert wait_job(server, done)["status"] == "succeeded"
            job_id = submit(server, "org/restart-GGUF:Q4_0")["job_id"]
            wait_bytes(server, job_id, 2 * MB)
        finally:
            server.stop()  # SIGTERM, mid-download
        left = partials(hf_home)
        assert len(left) == 1 and left[0].stat().st_size > 0, left  # kept for the resume

        old_pid = hub.pid
        hub.restart()  # no throttle now: the rest comes quickly
        with running_server(home, cfg, hub_env(hub, hf_home)) as again:
            listed = httpx.get(again.url + "/jobs", headers=again.admin_headers, timeout=10)
            jobs = {j["id"]: j for j in listed.json()["jobs"]}
            interrupted = jobs[job_id]
            assert interrupted["status"] == "interrupted", interrupted
            assert 0 < interrupted["bytes_done"] < SIZE
            assert interrupted["bytes_total"] == SIZE
            assert interrupted["error"]
            assert jobs[done]["status"] == "succeeded"  # finished jobs stay listed
            assert "org/done-gguf:q4_0" in openai_ids(again)
            assert "org/restart-gguf:q4_0" not in openai_ids(again)

            r = post(again, f"/jobs/{job_id}/resume")
            assert r.status_code == 200, r.text
            assert r.json()["status"] in ("queued", "running")
            job = wait_job(again, job_id)
            assert job["status"] == "succeeded", job
            assert job["bytes_done"] == job["bytes_total"] == SIZE
            poll(lambda: "org/restart-gguf:q4_0" in openai_ids(again), timeout_s=10,
                 what="the resumed model in the catalog")
            # A succeeded job is not resumed again.
            assert post(again, f"/jobs/{job_id}/resume").status_code == 400

        gets = resolve_requests(hub, "org/restart-GGUF", name)
        before = [g for g in gets if g["pid"] == old_pid]
        after = [g for g in gets if g["pid"] != old_pid]
        assert before and before[0]["range"] is None
        assert after and range_start(after[0]), f"the resume did not continue the file: {after}"
        assert after[0]["status"] == 206
        files = snapshot_files(hf_home, "org/restart-GGUF")
        assert sha256(files[name]) == sha256(hub_root / "org/restart-GGUF" / name)
        assert partials(hf_home) == []


# ---- 7. the disk reserve --------------------------------------------------------------------


def test_a_pull_that_would_eat_the_disk_reserve_fails_before_writing(
    tmp_path: Path, fast_hub: HubServer
) -> None:
    hf_home = tmp_path / "hf"
    cfg = config(reserve_free_bytes=10**15)
    with running_server(tmp_path / "home", cfg, hub_env(fast_hub, hf_home)) as server:
        job = wait_job(server, submit(server, "org/full-GGUF:Q4_0")["job_id"])
        assert job["status"] == "failed", job
        assert job["error_code"] == "insufficient_storage"
        assert "reserve_free_bytes" in job["error"]
        assert blobs(hf_home, "org/full-GGUF") == []
        assert partials(hf_home) == []
        assert "org/full-gguf:q4_0" not in openai_ids(server)

        r = post(server, "/api/pull", {"model": "org/full-GGUF:Q4_0", "stream": False},
                 timeout=60)
        assert r.status_code == 507, r.text
        assert "reserve_free_bytes" in r.json()["error"]


# ---- 9b and 10: the real llama-server with the real demo model ------------------------------


@pytest.mark.e2e
def test_auto_pull_downloads_a_named_model_then_answers(
    tmp_path: Path, demo_hub: HubServer
) -> None:
    hf_home = tmp_path / "hf"
    cfg = config(auto_pull=True, default_ctx_size=2048)
    with running_server(tmp_path / "home", cfg, hub_env(demo_hub, hf_home)) as server:
        assert "org/smol-gguf:q4_1" not in openai_ids(server)
        r = chat(server, "org/smol-GGUF:Q4_1")
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        assert isinstance(text, str) and text.strip()

        jobs = httpx.get(server.url + "/jobs",
                         headers=server.admin_headers, timeout=10).json()["jobs"]
        assert [(j["model_id"], j["status"]) for j in jobs] == [
            ("org/smol-gguf:q4_1", "succeeded")]
        assert "org/smol-gguf:q4_1" in openai_ids(server)
        files = snapshot_files(hf_home, "org/smol-GGUF")
        assert set(files) == {f"{SMOL}-Q4_1.gguf"}
        assert sha256(files[f"{SMOL}-Q4_1.gguf"]) == sha256(demo_gguf())
        # A second request finds it on disk: no new job.
        assert chat(server, "org/smol-gguf:q4_1", "ollama").status_code == 200
        assert len(httpx.get(server.url + "/jobs",
                             headers=server.admin_headers, timeout=10).json()["jobs"]) == 1


def cli(server: Server, *args: str,
        timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """The CLI as its user runs it: against this server, with the token first boot wrote."""
    env = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1", "MODELYARD_HOME": str(server.home)}
    return subprocess.run([sys.executable, "-m", "modelyard", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.mark.e2e
def test_cli_pull_chat_copy_and_rm(tmp_path: Path, demo_hub: HubServer) -> None:
    hf_home = tmp_path / "hf"
    model = "org/smol-gguf:q8_0"
    cfg = config(fake_model("configured"), default_ctx_size=2048)
    with running_server(tmp_path / "home", cfg, hub_env(demo_hub, hf_home)) as server:
        pulled = cli(server, "pull", "org/smol-GGUF:Q8_0", "--url", server.url)
        assert pulled.returncode == 0, pulled.stdout + pulled.stderr
        assert model in pulled.stdout

        # Pulled, so usable at once, under its id.
        r = chat(server, model)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"].strip()
        link = snapshot_files(hf_home, "org/smol-GGUF")[f"{SMOL}-Q8_0.gguf"]
        blob = link.resolve()
        assert blob.is_file() and blob.parent.name == "blobs"

        # Ollama's copy: a second name, listed and usable.
        r = post(server, "/api/copy", {"source": model, "destination": "my-smol"})
        assert r.status_code == 200, r.text
        assert "my-smol" in openai_ids(server) and model in openai_ids(server)
        r = chat(server, "my-smol", "ollama")
        assert r.status_code == 200, r.text
        assert r.json()["message"]["content"].strip()
        assert post(server, "/api/copy", {"source": model, "destination": "configured"}
                    ).status_code == 400

        # Models from the config are not modelyard's to delete.
        r = post(server, "/api/delete", {"model": "configured"})
        assert r.status_code == 400, r.text
        assert "configured" in r.json()["error"]
        assert "configured" in openai_ids(server)

        removed = cli(server, "rm", model, "--url", server.url)
        assert removed.returncode == 0, removed.stdout + removed.stderr
        assert not blob.exists() and not link.exists()
        assert _listed(server, model) == {"openai": False, "ollama": False, "native": False}
        assert "my-smol" not in openai_ids(server)
        r = chat(server, model, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_pulled"

        again = httpx.delete(f"{server.url}/models/{model}",
                             headers=server.admin_headers, timeout=30)
        assert again.status_code == 404, again.text
