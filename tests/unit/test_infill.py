"""/api/generate's `suffix` (front/chat/infill.py): fill in the middle through llama-server's
/infill for a GGUF with fill-in-the-middle tokens, Ollama's 400 for one without; llama-server's
own completion shape read by Generation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from modelyard.config import LlamaCppModel, TransformersModel
from modelyard.front.api.ollama import GenerateRequest, generate_payload
from modelyard.front.chat.infill import INFILL_PATH, supports_insert
from modelyard.front.chat.translate import Generation

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

SMOLLM = Path.home() / ".cache/modelyard/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf(path: Path, **keys: int) -> Path:
    writer = GGUFWriter(path, "llama")
    for key, value in keys.items():
        writer.add_uint32(key.replace("_", ".", 2), value)
    writer.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_only_a_gguf_with_fim_tokens_supports_insert(tmp_path: Path) -> None:
    fim = gguf(tmp_path / "fim.gguf", tokenizer_ggml_fim_pre_token_id=5)
    legacy = gguf(tmp_path / "legacy.gguf", tokenizer_ggml_prefix_token_id=5)
    plain = gguf(tmp_path / "plain.gguf")
    assert supports_insert(LlamaCppModel(id="a", path=fim))
    assert supports_insert(LlamaCppModel(id="b", path=legacy))
    assert not supports_insert(LlamaCppModel(id="c", path=plain))
    assert not supports_insert(LlamaCppModel(id="d", path=tmp_path / "missing.gguf"))
    assert not supports_insert(TransformersModel(id="e", path=tmp_path))
    if SMOLLM.is_file():  # the demo model has no fill-in-the-middle tokens
        assert not supports_insert(LlamaCppModel(id="smollm2", path=SMOLLM))


def test_suffix_goes_to_infill_in_llama_servers_names() -> None:
    req = GenerateRequest.model_validate(
        {"model": "m", "prompt": "def f(", "suffix": "return x", "stream": False,
         "options": {"num_predict": 8, "temperature": 0.1}, "format": "json"})
    path, body = generate_payload(req)
    assert path == INFILL_PATH
    assert body == {"model": "m", "stream": False, "n_predict": 8, "temperature": 0.1,
                    "input_prefix": "def f(", "input_suffix": "return x", "prompt": ""}


def test_generation_reads_llama_servers_own_shape() -> None:
    gen = Generation.start()
    assert gen.absorb({"index": 0, "content": "x = ", "stop": False}) == "x = "
    assert gen.absorb({"index": 0, "content": "1", "stop": False}) == "1"
    gen.absorb({"index": 0, "content": "", "stop": True, "stop_type": "limit",
                "tokens_predicted": 2, "tokens_evaluated": 9,
                "timings": {"cache_n": 0, "prompt_n": 9, "predicted_n": 2}})
    assert gen.content == "x = 1" and gen.done_reason == "length"
    assert (gen.prompt_tokens, gen.completion_tokens) == (9, 2)
    eos = Generation.start()
    eos.absorb({"content": "done", "stop": True, "stop_type": "eos"})
    assert eos.done_reason == "stop" and eos.content == "done"
