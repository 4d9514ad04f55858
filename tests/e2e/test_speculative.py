"""End to end: speculative decoding on the real llama-server, the demo model drafting for itself
(the mechanism, not a speed-up: docs/multi-gpu.md "Speculative decoding").

One modelyard server (so one llama-server with its draft) is shared by the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tests.support import Server, poll, require_e2e_artifact

from modelyard.config import DEMO_MODEL_FILE, Settings, cache_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PROMPT = [{"role": "user", "content": "Count from 1 to 30, separated by commas."}]
MODEL = "smol-spec"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_e2e_artifact(Settings().resolve_llama_server(), "llama-server")
    gguf = require_e2e_artifact(cache_dir() / "models" / DEMO_MODEL_FILE, "the demo model")
    home = tmp_path_factory.mktemp("spec-home")
    (home / "models").mkdir()
    (home / "models" / DEMO_MODEL_FILE).symlink_to(gguf)
    (home / "st-draft").mkdir()  # a safetensors model's place: never loaded here
    models = [
        # The draft named by catalog id: the demo model, found by itself as `smollm2`.
        {"id": MODEL, "backend": "llamacpp", "path": str(gguf), "draft_model": "smollm2",
         "draft_max": 4},
        {"id": "spec-missing", "backend": "llamacpp", "path": str(gguf),
         "draft_model": "no-such-draft"},
        {"id": "spec-wrong-family", "backend": "llamacpp", "path": str(gguf),
         "draft_model": "st-draft"},
        {"id": "st-draft", "backend": "transformers", "path": str(home / "st-draft")},
    ]
    srv = Server(home, {"scan_hf_cache": False, "default_ctx_size": 1024,
                        "llama_server_parallel": 1, "models": models})
    try:
        srv.wait_healthy(90)
        yield srv
    finally:
        srv.stop()


def _model_status(server: Server, model: str) -> dict[str, Any]:
    status = httpx.get(server.url + "/status", headers=server.admin_headers, timeout=10).json()
    return next(m for e in status["engines"] for m in e["models"] if m["model"] == model)


def test_paired_model_answers_and_status_shows_acceptance(server: Server) -> None:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)
    answer = oai.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=48, temperature=0  # type: ignore[arg-type]
    )
    assert answer.choices[0].message.content
    # The engine reads llama-server's draft counters once the request is released.
    spec = poll(lambda: (_model_status(server, MODEL).get("speculative") or {})
                if (_model_status(server, MODEL).get("speculative") or {}).get("drafted")
                else None, timeout_s=20, what="draft counts in /status")
    assert spec["draft_model"] == "smollm2"
    assert spec["drafted"] > 0
    assert 0 < spec["accepted"] <= spec["drafted"]
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["drafted"], abs=1e-3)
    assert spec["off_reason"] is None


def test_pair_is_one_process_with_the_draft_counted(server: Server) -> None:
    model = _model_status(server, MODEL)
    argv = Path(f"/proc/{model['pid']}/cmdline").read_bytes().split(b"\0")
    assert b"--model-draft" in argv
    assert argv[argv.index(b"--model-draft") + 1].endswith(DEMO_MODEL_FILE.encode())
    assert argv[argv.index(b"--spec-type") + 1] == b"draft-simple"
    assert argv[argv.index(b"--spec-draft-n-max") + 1] == b"4"
    estimate = model["memory"]["estimate"]
    # The draft is the same file: its weights count a second time, in the same server.
    assert estimate["draft_bytes"] > estimate["weights_bytes"]
    assert estimate["total_bytes"] > 2 * estimate["weights_bytes"]


def test_metrics_count_drafted_and_accepted(server: Server) -> None:
    def counted() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics", headers=server.admin_headers, timeout=10).text
        found = {}
        for line in text.splitlines():
            names = ("modelyard_draft_tokens_total{", "modelyard_draft_accepted_total{")
            if line.startswith(names) and f'model="{MODEL}"' in line:
                found[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
        return found if len(found) == 2 else {}

    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)
    # Greedy: the draft (the same model) then agrees with it, so some drafts are accepted; a
    # sampled answer might accept none, or end before anything was drafted.
    oai.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=16,  # type: ignore[arg-type]
                                temperature=0, seed=7)
    found = poll(counted, timeout_s=20, what="draft metrics")
    assert found["modelyard_draft_tokens_total"] > 0
    assert 0 < found["modelyard_draft_accepted_total"] <= found["modelyard_draft_tokens_total"]


def test_missing_draft_says_what_to_do(server: Server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "spec-missing", "messages": PROMPT, "max_tokens": 4})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "invalid_request" and error["param"] == "draft_model"
    assert "draft_model 'no-such-draft' of 'spec-missing'" in error["message"]
    assert "declare it" in error["message"]


def test_draft_of_another_family_is_a_400(server: Server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "spec-wrong-family", "messages": PROMPT, "max_tokens": 4})
    assert r.status_code == 400
    assert "GGUF" in r.json()["error"]["message"]
