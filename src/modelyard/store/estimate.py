"""Memory estimate of serving a GGUF model with llama-server, from its header alone.

An estimate is what the scheduler plans with before a model is loaded; after a load the engine
replaces it in its ledger with the measured usage, so the estimate errs on the generous side.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from modelyard.store.gguf import GgufInfo, MetadataValue

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

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.compute_bytes + self.mmproj_bytes

    def to_json(self) -> dict[str, int]:
        return {
            "weights_bytes": self.weights_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "compute_bytes": self.compute_bytes,
            "mmproj_bytes": self.mmproj_bytes,
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
