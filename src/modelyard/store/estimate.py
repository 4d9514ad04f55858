"""Memory estimates of serving a model, from its files' headers alone: GGUF for llama-server,
safetensors (+ config.json) for transformers and vLLM.

An estimate is what the scheduler plans with before a model is loaded; after a load the engine
replaces it in its ledger with the measured usage, so the estimate errs on the generous side.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from modelyard.config import (
    DEMO_MODEL_FILE,
    DEMO_MODEL_ID,
    LlamaCppModel,
    ModelSpec,
    ServiceModel,
    Settings,
    TransformersModel,
    draft_is_path,
)
from modelyard.store.gguf import GgufError, GgufInfo, MetadataValue, read_gguf_info

log = logging.getLogger("modelyard.store")

MIB = 1024 * 1024
GIB = 1024 * MIB

# Compute-buffer heuristic (see `_compute_bytes`).
_COMPUTE_FLOOR_BYTES = 64 * MIB
_UBATCH = 512  # llama-server's default --ubatch-size
_F32 = 4


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes needed to serve one model, by part."""

    weights_bytes: int
    kv_cache_bytes: int
    compute_bytes: int
    mmproj_bytes: int
    draft_bytes: int = 0  # a speculative-decoding draft served in the same process

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.kv_cache_bytes + self.compute_bytes + self.mmproj_bytes
                + self.draft_bytes)

    def to_json(self) -> dict[str, int]:
        return {
            "weights_bytes": self.weights_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "compute_bytes": self.compute_bytes,
            "mmproj_bytes": self.mmproj_bytes,
            **({"draft_bytes": self.draft_bytes} if self.draft_bytes else {}),
            "total_bytes": self.total_bytes,
        }


def gib(n: int) -> str:
    """`1610612736` -> "1.50 GiB", for messages."""
    return f"{n / GIB:.2f} GiB"


def _meta_int(meta: dict[str, MetadataValue], key: str) -> int | None:
    value = meta.get(key)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, list):  # per-layer values: the max is the safe figure
        ints = [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
        return max(ints) if ints else None
    return None


def _kv_cache_bytes(info: GgufInfo, cells: int, kv_dtype_bytes: float) -> int:
    """2 (K, V) x layers x kv-heads x head dim x cells x dtype; K and V head dims may differ."""
    arch, meta = info.architecture, info.metadata
    layers, heads = info.block_count, info.head_count
    key_len = _meta_int(meta, f"{arch}.attention.key_length")
    value_len = _meta_int(meta, f"{arch}.attention.value_length")
    missing = [k for k, v in (("block_count", layers), ("attention.head_count", heads)) if not v]
    if (key_len is None or value_len is None) and not info.embedding_length:
        missing.append("embedding_length")
    if missing or layers is None or heads is None:
        keys = ", ".join(f"{arch}.{k}" for k in missing)
        raise ValueError(f"{info.path}: cannot estimate the KV cache, metadata lacks {keys}")
    kv_heads = info.head_count_kv or heads  # absent: no grouped-query attention
    default_dim = (info.embedding_length or 0) // heads
    key_len = key_len if key_len is not None else default_dim
    value_len = value_len if value_len is not None else default_dim
    return int(layers * kv_heads * (key_len + value_len) * cells * kv_dtype_bytes)


def _compute_bytes(info: GgufInfo, cells: int) -> int:
    """Heuristic, in the spirit of llama.cpp's compute buffer sizes (not a measurement).

    A fixed floor, plus f32 activations over the context (cells x embedding length), plus the
    logits of one micro-batch (ubatch x vocabulary, when the vocabulary size is known).
    """
    vocab = _meta_int(info.metadata, f"{info.architecture}.vocab_size")
    vocab = vocab or _meta_int(info.metadata, "tokenizer.ggml.tokens") or 0
    activations = cells * (info.embedding_length or 0) * _F32
    return _COMPUTE_FLOOR_BYTES + activations + _UBATCH * vocab * _F32


def estimate_gguf(
    info: GgufInfo,
    *,
    ctx_size: int,
    parallel: int = 1,
    kv_dtype_bytes: float = 2.0,
    mmproj_path: Path | None = None,
) -> MemoryEstimate:
    """Estimate the memory llama-server needs for `info` with `-c ctx_size -np parallel`.

    - weights: the file size (all shards). It includes the header and metadata, a few MB at most,
      so it slightly overstates the tensor data; llama.cpp loads tensors at their stored size.
    - KV cache: for `ctx_size x parallel` cells (one context per slot) at `kv_dtype_bytes` per
      element (2 for f16, about 1.06 for q8_0).
    - compute buffers: a heuristic (see `_compute_bytes`); the engine corrects the ledger with the
      measured usage after a load.
    - mmproj: the projector file's size, when one is given.

    Raises ValueError when the metadata lacks the architecture keys the KV cache needs.
    """
    if ctx_size <= 0 or parallel <= 0 or kv_dtype_bytes <= 0:
        raise ValueError(
            f"ctx_size, parallel and kv_dtype_bytes must be positive "
            f"(got {ctx_size}, {parallel}, {kv_dtype_bytes})"
        )
    cells = ctx_size * parallel
    mmproj = Path(mmproj_path).stat().st_size if mmproj_path is not None else 0
    return MemoryEstimate(
        weights_bytes=info.size_bytes,
        kv_cache_bytes=_kv_cache_bytes(info, cells, kv_dtype_bytes),
        compute_bytes=_compute_bytes(info, cells),
        mmproj_bytes=mmproj,
    )


# Bytes per element of the safetensors dtypes (the header's names).
_SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
    "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}
# safetensors refuses headers above 100 MB; so do we, before allocating.
_MAX_SAFETENSORS_HEADER = 100_000_000


def safetensors_params(path: Path) -> dict[str, int]:
    """Element count per dtype in one .safetensors file, from its header alone."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        size = int.from_bytes(raw, "little")
        if size > _MAX_SAFETENSORS_HEADER:
            raise ValueError(f"{path}: safetensors header of {size} bytes is implausible")
        header = json.loads(f.read(size))
        data_bytes = f.seek(0, 2) - 8 - size
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    counts: dict[str, int] = {}
    end = 0
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        numel = math.prod(int(d) for d in tensor["shape"])
        counts[tensor["dtype"]] = counts.get(tensor["dtype"], 0) + numel
        end = max(end, int(tensor["data_offsets"][1]))
    if end > data_bytes:
        raise ValueError(f"{path}: truncated ({data_bytes} data bytes, header says {end})")
    return counts


def estimate_safetensors(
    repo_dir: Path, *, quantize_4bit: bool = False, ctx_size: int = 4096, parallel: int = 1
) -> MemoryEstimate:
    """Estimate a Hugging Face repo served by transformers/vLLM: the weights from the
    safetensors headers (their stored dtype; about a quarter of 16-bit for 4-bit NF4, which keeps
    small tensors in 16 bits), plus a KV cache from config.json when it says enough."""
    files = sorted(repo_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{repo_dir}: no .safetensors files")
    weights = 0
    for file in files:
        for dtype, numel in safetensors_params(file).items():
            stored = _SAFETENSORS_DTYPE_BYTES.get(dtype, 2) * numel
            weights += (numel // 2 + numel // 32) if quantize_4bit and numel else stored
    config = _read_json(repo_dir / "config.json")
    cells = ctx_size * parallel
    kv = _hf_kv_cache_bytes(config, cells)
    hidden = int(config.get("hidden_size") or 0)
    compute = _COMPUTE_FLOOR_BYTES + cells * hidden * _F32
    return MemoryEstimate(weights, kv, compute, 0)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    text = data.get("text_config")  # multimodal repos nest the language model's config
    return {**data, **text} if isinstance(text, dict) else data


def _hf_kv_cache_bytes(config: dict[str, Any], cells: int, dtype_bytes: int = 2) -> int:
    layers = int(config.get("num_hidden_layers") or 0)
    heads = int(config.get("num_attention_heads") or 0)
    if not layers or not heads:
        return 0
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or (int(config.get("hidden_size") or 0) // heads))
    return 2 * layers * kv_heads * head_dim * cells * dtype_bytes


def serving_bytes(
    spec: ModelSpec,
    estimate: MemoryEstimate | None,
    *,
    measured: int | None = None,
    file_bytes: int | None = None,
) -> int:
    """What placing `spec` must make room for — the one rule the engine plans with and the
    front routes with: a declared `vram_bytes`; a service's resident memory (none for one that
    manages its own); what an earlier load measured; the estimate; the files' size."""
    if spec.vram_bytes is not None:
        return spec.vram_bytes
    if isinstance(spec, ServiceModel):
        return 0 if spec.self_managed else spec.vram_resident_mib * MIB
    if measured:
        return measured
    return estimate.total_bytes if estimate else (file_bytes or 0)


def estimate_model(spec: ModelSpec, settings: Settings) -> MemoryEstimate | None:
    """What serving `spec` should take, from its files' headers; None when it cannot be told."""
    try:
        if isinstance(spec, LlamaCppModel):
            found = estimate_gguf(
                read_gguf_info(spec.path),
                ctx_size=spec.ctx_size or settings.default_ctx_size,
                parallel=settings.llama_server_parallel,
                mmproj_path=spec.mmproj,
            )
            return replace(found, draft_bytes=draft_bytes(spec, settings))
        if isinstance(spec, TransformersModel) and spec.path.is_dir():
            # Worst case in the batching loop: every slot at the full context, plus what the
            # prefix cache and the sessions' pinned KV may hold.
            ctx = spec.ctx_size or settings.default_ctx_size
            cells = ctx * spec.max_batch_size + spec.prefix_cache_tokens
            cells += spec.session_cache_tokens
            return estimate_safetensors(
                spec.path, ctx_size=cells, quantize_4bit=spec.quantize == "q4"
            )
        if spec.path is not None and spec.path.is_dir():
            return estimate_safetensors(
                spec.path, ctx_size=getattr(spec, "ctx_size", None) or settings.default_ctx_size
            )
    except (GgufError, ValueError, OSError, KeyError, TypeError) as exc:
        log.warning("no memory estimate for %s: %s", spec.id, exc)
    return None


def draft_bytes(spec: LlamaCppModel, settings: Settings) -> int:
    """What `spec`'s speculative-decoding draft adds to its server: the draft's weights, its KV
    cache at the same context and slots as the target's (llama-server gives every slot a draft
    context of the slot's size) and its compute buffers. The engine passes a resolved path
    (store/draft.py); a catalog id is looked up among the declared models and the demo, else
    the draft is not counted here (the measure after its load still is)."""
    name = spec.draft_model
    if name is None:
        return 0
    path: Path | None = Path(name).expanduser() if draft_is_path(name) else None
    if path is None:
        declared = next((m for m in settings.models if isinstance(m, LlamaCppModel)
                         and name in (m.id, *m.aliases)), None)
        demo = settings.models_dir / DEMO_MODEL_FILE
        path = declared.path if declared else demo if name == DEMO_MODEL_ID else None
    if path is None or not path.is_file():
        return 0
    found = estimate_gguf(read_gguf_info(path), ctx_size=spec.ctx_size or settings.default_ctx_size,
                          parallel=settings.llama_server_parallel)
    return found.weights_bytes + found.kv_cache_bytes + found.compute_bytes
