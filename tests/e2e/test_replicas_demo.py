"""End to end: two copies of the demo model (`replicas: 2`), each its own real llama-server.

The copies answer under the model's name (llama-server's `--alias` is the model's, not the
copy's), a chat session's turns run on one copy with its KV saved and restored there, and both
copies hold their own measured memory.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from tests.support import Server, require_e2e_artifact

from modelyard.config import DEMO_MODEL_FILE, Settings, cache_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PROMPT = [{"role": "user", "content": "Name one colour of the rainbow."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_e2e_artifact(Settings().resolve_llama_server(), "llama-server")
    gguf = require_e2e_artifact(cache_dir() / "models" / DEMO_MODEL_FILE, "the demo model")
    home = tmp_path_factory.mktemp("e2e-home")
    model = {"id": "smol", "backend": "llamacpp", "path": str(gguf), "replicas": 2}
    srv = Server(home, {"scan_hf_cache": False, "embedding_demo": False,
                        "default_ctx_size": 2048, "models": [model]})
    try:
        srv.wait_healthy(120)
        yield srv
    finally:
        srv.stop()


def _models(server: Server) -> dict[str, dict[str, object]]:
    body = httpx.get(server.url + "/status", headers=server.admin_headers, timeout=10).json()
    return {m["model"]: m for e in body["engines"] for m in e["models"]}


def test_both_copies_run_and_answer_as_the_model(server: Server) -> None:
    held = _models(server)
    assert held["smol"]["state"] == held["smol#2"]["state"] == "ready"
    assert held["smol"]["pid"] != held["smol#2"]["pid"]
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)
    for _ in range(2):
        # greedy: the text is asserted, and a sampled answer may end at once
        answer = oai.chat.completions.create(model="smol", messages=PROMPT, max_tokens=8,
                                             temperature=0, seed=7)
        assert answer.model == "smol" and answer.choices[0].message.content


def test_a_session_turn_answers_on_a_copy_with_its_slots(server: Server) -> None:
    url = server.url + "/v1/chat/completions"
    for text in ("My name is Ada.", "What is my name?"):
        r = httpx.post(url, json={"model": "smol", "session_id": "e2e-copy", "max_tokens": 8,
                                  "messages": [{"role": "user", "content": text}]}, timeout=120)
        assert r.status_code == 200, r.text
    copies = httpx.get(server.url + "/status", headers=server.admin_headers,
                       timeout=10).json()["replicas"]["smol"]["copies"]
    assert [c["model"] for c in copies] == ["smol", "smol#2"]
    assert all(c["work"] == 0 for c in copies)
