"""A node without the front's files pulls a pulled model there first (engine/node_pull.py).

One machine plays two: the front pulls `org/smol-GGUF:Q4_1` from the fake Hub (a real HTTP
server process serving the real demo GGUF) into its HF_HOME, then that copy is removed, as if it
lay on another machine. The engine runs as a cluster's does (`MODELYARD_CLUSTER_TOKEN_FILE` in
its environment: its catalog is pushed only) with its OWN HF_HOME (engine_specs env). A chat
to the model makes the engine pull it into its own HF_HOME — the revision the front pulled — and
answer with the real llama-server; the next request pulls nothing. A model that did not come from
a hub still answers 503 model_files_missing.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.fakes.hub_repos import HubServer
from tests.integration.harness import HELLO, config, status
from tests.integration.pull_support import (
    demo_repo,
    hub_env,
    repo_cache,
    resolve_requests,
    running_server,
    snapshot_files,
    submit,
    wait_job,
)
from tests.integration.test_pulls import SMOL, chat, demo_gguf
from tests.support import Server, require_e2e_artifact

from modelyard.config import Settings
from modelyard.wire.cluster import TOKEN_FILE_ENV

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(180)]

REPO = "org/smol-GGUF"
MODEL = "org/smol-gguf:q4_1"
FILE = f"{SMOL}-Q4_1.gguf"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_e2e_artifact(Settings().resolve_llama_server(), "llama-server")
    demo = demo_gguf()
    base = tmp_path_factory.mktemp("node-pulls")
    root = base / "repos"
    demo_repo(root, REPO, demo, ("Q4_1",))
    front_hf, node_hf = base / "front-hf", base / "node-hf"
    engine_env = {"HF_HOME": str(node_hf), TOKEN_FILE_ENV: str(base / "no-token-needed-here")}
    nofile = {"id": "nofile", "backend": "llamacpp", "path": str(base / "elsewhere.gguf")}
    cfg = config(nofile, default_ctx_size=2048, engine_specs={0: {"env": engine_env}},
                 notify_model_swap=True)
    with HubServer(root, log=base / "hub.jsonl") as hub, \
            running_server(base / "home", cfg, hub_env(hub, front_hf)) as server:
        yield {"server": server, "hub": hub, "front_hf": front_hf, "node_hf": node_hf,
               "demo": demo}


def _missing(server: Server) -> list[str]:
    return list(status(server)["engines"][0]["missing_files"])


def _push(server: Server, name: str) -> None:
    """A catalog change (an alias), so that the front pushes its catalog again."""
    r = httpx.post(server.url + "/api/copy", json={"source": "nofile", "destination": name},
                   headers=server.admin_headers, timeout=30)
    assert r.is_success, r.text


def _streamed_chat(server: Server, model: str) -> tuple[list[str], str]:
    """(the swap progress lines, the answer) of a streamed OpenAI chat."""
    body = {"model": model, "messages": HELLO, "max_tokens": 12, "temperature": 0,
            "stream": True}
    progress: list[str] = []
    answer = ""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers=server.admin_headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                progress += (choice["delta"].get("reasoning_content") or "").splitlines()
                answer += choice["delta"].get("content") or ""
    return progress, answer


def test_a_node_that_lacks_a_pulled_model_pulls_it_then_answers(node: dict[str, Any]) -> None:
    server: Server = node["server"]
    hub: HubServer = node["hub"]
    job = submit(server, f"{REPO}:Q4_1")["job"]
    assert wait_job(server, job["id"])["status"] == "succeeded"
    assert FILE in snapshot_files(node["front_hf"], REPO)
    assert len(resolve_requests(hub, REPO, FILE)) == 1
    # The front's copy is on "another machine": this node cannot see it.
    shutil.rmtree(repo_cache(node["front_hf"], REPO))
    _push(server, "nofile-1")
    assert MODEL in _missing(server)
    assert not repo_cache(node["node_hf"], REPO).exists()

    progress, answer = _streamed_chat(server, MODEL)
    assert answer.strip()
    assert f"pulling {MODEL} to this node" in progress, progress
    assert f"pulling {MODEL} to this node: 100%" in progress, progress
    pulled = snapshot_files(node["node_hf"], REPO)
    assert set(pulled) == {FILE}  # in the node's own HF_HOME
    assert _sha256(pulled[FILE]) == _sha256(node["demo"])
    assert not repo_cache(node["front_hf"], REPO).exists()  # not the front's
    assert len(resolve_requests(hub, REPO, FILE)) == 2
    assert MODEL not in _missing(server)

    # The next request, and the next push of the catalog: served from the node's copy.
    _push(server, "nofile-2")
    assert MODEL not in _missing(server)
    assert chat(server, MODEL, "ollama").status_code == 200
    assert len(resolve_requests(hub, REPO, FILE)) == 2


def test_a_model_that_did_not_come_from_a_hub_is_still_503_files_missing(
    node: dict[str, Any],
) -> None:
    server: Server = node["server"]
    assert "nofile" in _missing(server)
    r = chat(server, "nofile")
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "model_files_missing"
