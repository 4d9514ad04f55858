"""End to end: the real llama-server started by the ChildServer for a partial-offload placement
(and for a split over two GPUs).

On a CPU-only build llama-server accepts `--n-gpu-layers` and the split flags and keeps every
layer in host RAM; what this proves is that the command line modelyard renders for an offload is
one the pinned binary starts with and serves from, and that it is the one docs/multi-gpu.md
documents. (tests/gpu/test_multi_gpu_gpu.py shows the layers really move on a GPU.)
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from tests.support import ROOT, require_e2e_artifact

from modelyard.config import DEMO_MODEL_FILE, LlamaCppModel, Settings, cache_dir
from modelyard.engine.backends.openai_server import ChildServer
from modelyard.placement.devices import Placement

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MIB = 2**20
# The demo model (SmolLM2-135M, 30 layers) with 10 layers on GPU 0 and the rest in host RAM.
OFFLOAD = Placement(device_bytes=((0, 40 * MIB),), host_bytes=60 * MIB, layers=(10,),
                    total_layers=30)
# The flags docs/multi-gpu.md shows for that placement ("What each backend is told").
DOCUMENTED = "--n-gpu-layers 10 --split-mode none --main-gpu 0 --fit off"
# Over two GPUs by layers: on a CPU-only build the flags must still be accepted.
SPLIT = Placement(device_bytes=((0, 50 * MIB), (1, 50 * MIB)), layers=(14, 16), total_layers=30)
SPLIT_FLAGS = "--n-gpu-layers 999 --split-mode layer --tensor-split 14,16 --main-gpu 0 --fit off"


@pytest.mark.parametrize(("placement", "flags"), [(OFFLOAD, DOCUMENTED), (SPLIT, SPLIT_FLAGS)],
                         ids=["offload", "split"])
async def test_a_placement_starts_and_answers(tmp_path: Path, placement: Placement,
                                              flags: str) -> None:
    binary = require_e2e_artifact(Settings().resolve_llama_server(), "llama-server")
    gguf = require_e2e_artifact(cache_dir() / "models" / DEMO_MODEL_FILE, "the demo model")
    settings = Settings(home=tmp_path, llama_server_path=binary, default_ctx_size=512,
                        llama_server_parallel=1)
    server = ChildServer(LlamaCppModel(id="demo", path=gguf), settings)
    visible = ",".join(str(d) for d in placement.devices)
    server.place(placement, {"CUDA_VISIBLE_DEVICES": visible})
    argv = server.process.argv
    assert flags in " ".join(argv)
    assert argv.count("--n-gpu-layers") == 1 and argv.count("--fit") == 1
    try:
        await server.start()
        async with httpx.AsyncClient(base_url=server.url, timeout=60, headers={
                "Authorization": f"Bearer {server.api_key}"}) as http:  # the load's key
            health = await http.get("/health")
            assert health.status_code == 200
            r = await http.post("/v1/completions", json={
                "model": "demo", "prompt": "The sky is", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] > 0
    finally:
        await server.stop()
    assert not server.alive


def test_the_documented_offload_line_is_in_the_docs() -> None:
    assert DOCUMENTED in (ROOT / "docs" / "multi-gpu.md").read_text(encoding="utf-8")
