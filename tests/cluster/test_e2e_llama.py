"""End to end on a cluster: the real llama-server with the demo model, on each of two nodes.

The same GGUF is declared twice, each pinned to one node's engine, so one answer comes from each
node; the model servers are children of that node's engine (under its Ray raylet).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from tests.cluster.harness import NODES, RayTestCluster, engines, model_on, wait_engines
from tests.support import Server, require_e2e_artifact

from modelyard.config import DEMO_MODEL_FILE, Settings, cache_dir

pytest.importorskip("ray", reason="the cluster tier needs the `cluster` extra")

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(240)]

PROMPT = [{"role": "user", "content": "Name one colour of the rainbow."}]


@pytest.fixture(scope="module")
def front(ray_cluster: RayTestCluster) -> Iterator[Server]:
    require_e2e_artifact(Settings().resolve_llama_server(), "llama-server")
    gguf = require_e2e_artifact(cache_dir() / "models" / DEMO_MODEL_FILE, "the demo model")
    models = [{"id": f"smol-{host}", "backend": "llamacpp", "path": str(gguf),
               "engine": f"{host}/engine-0"} for host in NODES]
    server = ray_cluster.front(*models, default_ctx_size=2048)
    wait_engines(server, {f"{h}/engine-0" for h in NODES})
    yield server


def test_each_node_answers_with_its_own_llama_server(front: Server) -> None:
    pids = {}
    for host in NODES:
        model = f"smol-{host}"
        r = httpx.post(front.url + "/v1/chat/completions", timeout=180,
                       # greedy: the text is asserted, and a sampled answer may end at once
                       json={"model": model, "messages": PROMPT, "max_tokens": 8,
                             "temperature": 0, "seed": 7})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model and r.json()["choices"][0]["message"]["content"]
        held = model_on(front, model)
        assert held["backend"] == "llamacpp"
        pids[host] = held["pid"]
        # it runs under that node's engine, not the other's
        assert model in {m["model"] for m in engines(front)[f"{host}/engine-0"]["models"]}
    assert len(set(pids.values())) == len(NODES)  # two processes, one per node
