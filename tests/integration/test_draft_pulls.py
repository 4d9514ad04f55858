"""Speculative decoding's pairs are pulled together (docs/multi-gpu.md): a real `modelyard serve`
pulling from the fake Hub (tests/fakes/fake_hub.py, a real HTTP server process). Pulling a
declared model (by the catalog id one of its aliases names) also pulls its hub draft, in a
second job; both are in the catalog and on disk once they succeed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.fakes.hub_repos import HubServer, fake_gguf
from tests.integration.harness import config
from tests.integration.pull_support import (
    hub_env,
    native_models,
    quant_repo,
    running_server,
    snapshot_files,
    submit,
    wait_job,
)
from tests.support import Server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MB = 1_000_000
DRAFT = "hf.co/org/small-GGUF:Q4_0"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    base = tmp_path_factory.mktemp("draft-pulls")
    root = base / "repos"
    quant_repo(root, "org/big-GGUF", 2 * MB, ("Q4_0",), seed=1, stem="Big")
    quant_repo(root, "org/small-GGUF", 1 * MB, ("Q4_0",), seed=2, stem="Small")
    local = fake_gguf(base / "big-local.gguf", 300_000, seed=3)
    hf_home = base / "hf"
    big = {"id": "big", "backend": "llamacpp", "path": str(local), "aliases": ["org/big-gguf:q4_0"],
           "draft_model": DRAFT}
    with HubServer(root, log=base / "hub.jsonl") as hub, \
            running_server(base / "home", config(big), hub_env(hub, hf_home)) as server:
        yield server, hf_home


def test_pulling_a_declared_model_pulls_its_hub_draft(pair: tuple[Server, Path]) -> None:
    server, hf_home = pair
    assert "org/small-gguf:q4_0" not in native_models(server)
    job = submit(server, "hf.co/org/big-GGUF:Q4_0")["job"]
    assert wait_job(server, job["id"])["status"] == "succeeded"
    jobs = httpx.get(server.url + "/jobs", headers=server.admin_headers, timeout=10).json()
    listed = jobs["jobs"] if isinstance(jobs, dict) else jobs
    drafts = [j for j in listed if j["model"] == DRAFT]
    assert len(drafts) == 1, listed  # the second job, submitted by the first one's success
    assert wait_job(server, drafts[0]["id"])["status"] == "succeeded"
    assert "org/small-gguf:q4_0" in native_models(server)
    assert "Small-Q4_0.gguf" in snapshot_files(hf_home, "org/small-GGUF")
    assert "Big-Q4_0.gguf" in snapshot_files(hf_home, "org/big-GGUF")
