"""How a transformers model is loaded: 4-bit, 16-bit or 32-bit, decided before torch is touched.

`quantize: auto` means 4-bit NF4 (bitsandbytes) when CUDA is present and the weights are larger
than `q4_threshold_bytes`, else 16-bit on a GPU (bf16 where supported) and 32-bit on the CPU —
on a CPU, 16-bit matmuls are slower than 32-bit ones unless it has native bf16 units, and
modelyard cannot tell that reliably. Asking for `q4` where it cannot run is the user's error: a
400 that says why, not a crash in bitsandbytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from modelyard.errors import InvalidRequest

Quantize = Literal["auto", "q4", "fp16", "no"]


@dataclass(frozen=True)
class Precision:
    load_in_4bit: bool
    dtype: Literal["float32", "float16", "bfloat16"]
    why: str


def choose_precision(
    quantize: Quantize,
    *,
    cuda: bool,
    bf16_supported: bool,
    bitsandbytes: bool,
    weights_bytes: int,
    q4_threshold_bytes: int,
) -> Precision:
    half: Literal["float16", "bfloat16"] = "bfloat16" if bf16_supported else "float16"
    if quantize == "q4":
        if not cuda:
            raise InvalidRequest(
                "quantize q4 needs a CUDA GPU (bitsandbytes NF4); this engine has none — use "
                "quantize auto, fp16 or no, or a GGUF quant of the model", param="quantize",
            )
        if not bitsandbytes:
            raise InvalidRequest(
                "quantize q4 needs bitsandbytes: pip install 'modelyard[gpu]' bitsandbytes",
                param="quantize",
            )
        return Precision(True, half, "q4 asked")
    if quantize == "fp16":
        return Precision(False, half if cuda else "float32" if not bf16_supported else half,
                         "fp16 asked" + ("" if cuda else " (on the CPU where supported)"))
    if quantize == "no":
        return Precision(False, "float32", "no quantization asked")
    if cuda and bitsandbytes and weights_bytes > q4_threshold_bytes:
        return Precision(True, half, f"auto: {weights_bytes / 1e9:.1f} GB > threshold on CUDA")
    if cuda:
        return Precision(False, half, "auto: 16-bit on CUDA")
    return Precision(False, "float32", "auto: 32-bit on the CPU")
