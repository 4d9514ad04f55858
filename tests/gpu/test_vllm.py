"""On a CUDA machine with vLLM: a safetensors model served by a child `vllm serve`, and the same
model through the in-process transformers backend with 4-bit NF4 (bitsandbytes)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import httpx
import pytest
from tests.support import STANDIN_MODELS, Server

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def demo_repo() -> Path:
    path = os.environ.get("MODELYARD_DEMO_SAFETENSORS")
    if not path or not Path(path).is_dir():
        pytest.skip("MODELYARD_DEMO_SAFETENSORS is not set (make demo-safetensors)")
    return Path(path)


@pytest.mark.parametrize("runtime", ["vllm", "transformers"])
def test_safetensors_model_on_a_gpu(tmp_path: Path, runtime: str) -> None:
    if runtime == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    if runtime == "transformers" and importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed (4-bit NF4 needs it)")
    model = {"id": "smol", "backend": "transformers", "path": str(demo_repo()),
             "runtime": runtime, "quantize": "q4" if runtime == "transformers" else "auto"}
    server = Server(tmp_path / "home", {"scan_hf_cache": False, "models": [model]})
    try:
        server.wait_healthy(120)
        r = httpx.post(server.url + "/v1/chat/completions", timeout=600,
                       json={"model": "smol", "messages": QUESTION, "max_tokens": 12,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["message"]["content"]
        assert "Paris" in content or (STANDIN_MODELS and content)
    finally:
        server.stop()
