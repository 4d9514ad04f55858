"""How a safetensors model is run: precision (4/16/32-bit) and vLLM vs in-process, as tables."""

from pathlib import Path

import pytest

from modelyard.config import TransformersModel
from modelyard.engine.backends.base import use_vllm, vllm_spec
from modelyard.engine.backends.openai_server import render_argv
from modelyard.engine.backends.transformers.precision import choose_precision
from modelyard.errors import InvalidRequest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

BIG, SMALL, LIMIT = 20_000_000_000, 1_000_000_000, 14_000_000_000


@pytest.mark.parametrize(
    ("quantize", "cuda", "bf16", "bnb", "size", "four_bit", "dtype"),
    [
        ("auto", True, True, True, BIG, True, "bfloat16"),     # big on CUDA: NF4
        ("auto", True, False, True, BIG, True, "float16"),
        ("auto", True, True, False, BIG, False, "bfloat16"),   # no bitsandbytes: 16-bit
        ("auto", True, True, True, SMALL, False, "bfloat16"),  # small: 16-bit
        ("auto", False, False, False, BIG, False, "float32"),  # CPU: 32-bit
        ("fp16", True, False, True, SMALL, False, "float16"),
        ("fp16", False, False, False, SMALL, False, "float32"),
        ("no", True, True, True, BIG, False, "float32"),
        ("q4", True, True, True, SMALL, True, "bfloat16"),
    ],
)
def test_precision(quantize: str, cuda: bool, bf16: bool, bnb: bool, size: int,
                   four_bit: bool, dtype: str) -> None:
    p = choose_precision(quantize, cuda=cuda, bf16_supported=bf16,  # type: ignore[arg-type]
                         bitsandbytes=bnb, weights_bytes=size, q4_threshold_bytes=LIMIT)
    assert (p.load_in_4bit, p.dtype) == (four_bit, dtype)
    assert p.why


@pytest.mark.parametrize(("cuda", "bnb", "needs"), [(False, True, "CUDA"),
                                                     (True, False, "bitsandbytes")])
def test_q4_where_it_cannot_run_is_a_400_naming_why(cuda: bool, bnb: bool, needs: str) -> None:
    with pytest.raises(InvalidRequest, match=needs) as err:
        choose_precision("q4", cuda=cuda, bf16_supported=False, bitsandbytes=bnb,
                         weights_bytes=SMALL, q4_threshold_bytes=LIMIT)
    assert err.value.status == 400 and err.value.param == "quantize"


def test_vllm_is_used_only_when_asked_or_present_with_cuda(tmp_path: Path) -> None:
    spec = TransformersModel(id="m", path=tmp_path, ctx_size=8192, quantize="q4",
                             runtime="vllm", vllm_args=["--gpu-memory-utilization", "0.5"])
    assert use_vllm(spec)
    assert not use_vllm(spec.model_copy(update={"runtime": "transformers"}))
    # auto on this machine: no vllm package (and no CUDA) → in-process transformers
    assert not use_vllm(spec.model_copy(update={"runtime": "auto"}))
    child = vllm_spec(spec)
    argv = render_argv(child.argv, {"path": str(tmp_path), "id": "m", "host": "127.0.0.1",
                                    "port": "9000", "ctx": "8192"})
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag in (["--model", str(tmp_path)], ["--served-model-name", "m"], ["--port", "9000"],
                 ["--max-model-len", "8192"], ["--quantization", "bitsandbytes"],
                 ["--gpu-memory-utilization", "0.5"]):
        i = argv.index(flag[0])
        assert argv[i:i + 2] == flag
    assert "--enable-sleep-mode" in argv
