"""End to end: the real llama-server runs the demo model with a q8_0 KV cache and flash
attention on (the `cache_type_k/v` and `flash_attn` fields), answers, and /status shows the
estimate that counts them. One modelyard server for the module."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.support import Server, require_e2e_artifact

from modelyard.config import DEMO_MODEL_FILE, Settings, cache_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_e2e_artifact(Settings().resolve_llama_server(), "llama-server")
    gguf = require_e2e_artifact(cache_dir() / "models" / DEMO_MODEL_FILE, "the demo model")
    home = tmp_path_factory.mktemp("kv-home")
    model = {"id": "smol-q8kv", "backend": "llamacpp", "path": str(gguf), "ctx_size": 1024,
             "cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on",
             # llama-server logs its KV buffer's size at this verbosity
             "extra_args": ["--log-verbosity", "4"]}
    srv = Server(home, {"scan_hf_cache": False, "llama_server_parallel": 2, "models": [model]})
    try:
        srv.wait_healthy(90)
        yield srv
    finally:
        srv.stop()


def test_q8_0_cache_with_flash_attention_answers(server: Server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "smol-q8kv", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Name one colour of the rainbow."}],
    })
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].strip()

    status = httpx.get(server.url + "/status", headers=server.admin_headers).json()
    model = next(m for m in status["engines"][0]["models"] if m["model"] == "smol-q8kv")
    # The child really got the flags (llama-server refuses a type it does not know).
    argv = Path(f"/proc/{model['pid']}/cmdline").read_bytes().split(b"\0")
    line = b" ".join(argv).decode()
    assert "--cache-type-k q8_0 --cache-type-v q8_0 --flash-attn on" in line
    estimate = model["memory"]["estimate"]
    assert (estimate["kv_cache_type"], estimate["flash_attn"]) == ("q8_0", "on")
    assert (estimate["ctx_per_slot"], estimate["slots"]) == (1024, 2)
    # 30 layers x 2048 cells x (K + V rows of 3 kv heads x 64 = 6 q8_0 blocks of 34 bytes)
    assert estimate["kv_cache_bytes"] == 30 * 2048 * (204 + 204)
    assert estimate["layers"] == 30
    # Memory truth: llama-server's own account of its KV cache is the estimate's, to its
    # rounding ("llama_kv_cache: size =   23.91 MiB ( 1024 cells, 30 layers, 2/2 seqs)").
    log = (server.home / "logs" / "models" / "smol-q8kv.log").read_text(errors="replace")
    sizes = re.findall(r"llama_kv_cache: size =\s*([0-9.]+) MiB", log)
    assert sizes, log[-2000:]
    assert abs(float(sizes[-1]) - estimate["kv_cache_bytes"] / 2**20) < 0.01
