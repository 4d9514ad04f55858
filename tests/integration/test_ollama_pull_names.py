"""Ollama's /api/pull of a plain name, with the official `ollama` client, against a real
`modelyard serve` and the fake Hub (tests/fakes/fake_hub.py, a real HTTP server process):
a model already here answers success at once; a library name maps to a Hub GGUF (the built-in
table, or `pull_aliases` in the config) and is pulled, then names what it pulled; any other
plain name is a 404 naming the Hub form (front/api/pulls.py, store/ollama_library.py)."""

from __future__ import annotations

from collections.abc import Iterator

import ollama
import pytest
from tests.e2e.compat.table import covers
from tests.fakes.hub_repos import HubServer
from tests.integration.harness import config
from tests.integration.pull_support import (
    hub_env,
    ollama_names,
    quant_repo,
    resolve_requests,
    running_server,
)
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MB = 1_000_000
REPO = "org/llama-GGUF"  # what the config's pull_aliases maps `llama3.2:1b` to
FILE = "Model-Q4_K_M.gguf"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    root = tmp_path_factory.mktemp("hub") / "repos"
    quant_repo(root, REPO, 1 * MB, ("Q4_K_M",), seed=1)
    with HubServer(root, log=root.parent / "hub.jsonl") as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, hub: HubServer) -> Iterator[Server]:
    base = tmp_path_factory.mktemp("pull-names")
    cfg = config(fake_model("present"),
                 pull_aliases={"Llama3.2:1B": f"{REPO}:Q4_K_M"})  # over the built-in entry
    with running_server(base / "home", cfg, hub_env(hub, base / "hf")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=60, headers=server.admin_headers)


@covers("Pull (`/api/pull`)", "Ollama")
@pytest.mark.parametrize("name", ["present", "present:latest", "PRESENT"])
def test_a_model_already_here_is_pulled_at_once(client: ollama.Client, hub: HubServer,
                                                name: str) -> None:
    asked = len(hub.log_lines())
    assert client.pull(name).status == "success"
    statuses = [p.status for p in client.pull(name, stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert len(hub.log_lines()) == asked  # the Hub was not asked


@covers("Pull (`/api/pull`)", "Ollama")
def test_a_library_name_maps_to_a_hub_gguf_and_then_names_it(client: ollama.Client,
                                                             server: Server,
                                                             hub: HubServer) -> None:
    statuses = [p.status for p in client.pull("llama3.2:1b", stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert f"pulling {FILE}" in statuses
    assert len(resolve_requests(hub, REPO, FILE)) >= 1
    assert "org/llama-gguf:q4_k_m" in ollama_names(server)
    # The library name now reaches the pulled model: a second pull is at once.
    assert client.show("llama3.2:1b").details is not None
    fetched = len(resolve_requests(hub, REPO, FILE))
    assert client.pull("Llama3.2:1B").status == "success"
    assert len(resolve_requests(hub, REPO, FILE)) == fetched


def test_the_built_in_table_is_asked_of_the_hub(client: ollama.Client, hub: HubServer) -> None:
    # smollm2:1.7b is in the built-in table; the fake Hub has no such repo: its 404 comes back.
    with pytest.raises(ollama.ResponseError) as err:
        client.pull("smollm2:1.7b")
    assert err.value.status_code == 404
    assert "bartowski/SmolLM2-1.7B-Instruct-GGUF" in err.value.error
    assert any("/bartowski/SmolLM2-1.7B-Instruct-GGUF" in r["path"] for r in hub.log_lines())


@covers("Pull (`/api/pull`)", "Ollama")
@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_plain_name_is_a_404_naming_the_hub_form(client: ollama.Client,
                                                            stream: bool) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        out = client.pull("no-such-model:7b", stream=stream)
        if stream:
            list(out)  # type: ignore[arg-type]
    assert err.value.status_code == 404
    assert "hf.co/<org>/<repo>" in err.value.error and "pull_aliases" in err.value.error

