"""Memory estimates of serving a model, from its files' headers alone: GGUF for llama-server,
safetensors (+ config.json) for transformers and vLLM.

An estimate is what the scheduler plans with before a model is loaded; after a load the engine
replaces it in its ledger with the measured usage, so the estimate errs on the generous side.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

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
from modelyard.placement.devices import LayerProfile
from modelyard.store.gguf import GgufError, GgufInfo, MetadataValue, read_gguf_info
from modelyard.store.llama_options import DEFAULT_UBATCH, memory_options

log = logging.getLogger("modelyard.store")

MIB = 1024 * 1024
GIB = 1024 * MIB

# Compute-buffer heuristic (see `_compute_bytes`).
_COMPUTE_FLOOR_BYTES = 64 * MIB
_F32 = 4


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes needed to serve one model, by part; and, when the files tell, by layer.

    The fields after the four parts describe how the estimate was made (they are not compared):
    `profile` is the same memory by layer (what a split over devices or a partial offload
    places; its `bytes_on_one_device()` equals `total_bytes`), the rest the served context and
    KV cache, shown in the estimate's JSON."""

    weights_bytes: int
    kv_cache_bytes: int
    compute_bytes: int
    mmproj_bytes: int
    profile: LayerProfile | None = field(default=None, compare=False)
    kv_cache_type: str | None = field(default=None, compare=False)  # "q8_0", or "q8_0/f16" (K/V)
    flash_attn: str | None = field(default=None, compare=False)
    ctx_per_slot: int | None = field(default=None, compare=False)
    slots: int | None = field(default=None, compare=False)
    draft_bytes: int = 0  # a speculative-decoding draft served in the same process

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.kv_cache_bytes + self.compute_bytes + self.mmproj_bytes
                + self.draft_bytes)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "weights_bytes": self.weights_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "compute_bytes": self.compute_bytes,
            "mmproj_bytes": self.mmproj_bytes,
            **({"draft_bytes": self.draft_bytes} if self.draft_bytes else {}),
            "total_bytes": self.total_bytes,
        }
        extra = {"kv_cache_type": self.kv_cache_type, "flash_attn": self.flash_attn,
                 "ctx_per_slot": self.ctx_per_slot, "slots": self.slots}
        out.update({k: v for k, v in extra.items() if v is not None})
        if self.profile is not None:
            out["layers"] = self.profile.layers
        return out


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


def cache_type_row_bytes(cache_type: str, elements: int) -> int:
    """Bytes of `elements` values of a KV cache type, as ggml stores them: blocks of
    `block size` values in `type size` bytes (q8_0: 32 values in 34 bytes; q4_0: 32 in 18;
    f16: 1 in 2). An unknown name counts as f16, llama-server's default."""
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[cache_type.upper()]]
    except KeyError:
        block, size = 1, 2
    return -(-elements // block) * size  # ggml rounds a row up to whole blocks


def _kv_bytes_per_layer(
    info: GgufInfo, cells: int, cache_type_k: str, cache_type_v: str,
    kv_dtype_bytes: float | None = None,
) -> int:
    """One layer's K and V caches: cells x (kv-heads x key length) in the K type, plus the same
    with the value length in the V type (K and V head dims may differ, as may their types).
    `kv_dtype_bytes` overrides both types with a flat size per element."""
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
    if kv_dtype_bytes is not None:
        return int(kv_heads * (key_len + value_len) * cells * kv_dtype_bytes)
    return cells * (cache_type_row_bytes(cache_type_k, kv_heads * key_len)
                    + cache_type_row_bytes(cache_type_v, kv_heads * value_len))


def _compute_bytes(
    info: GgufInfo, cells: int, *, flash_attn: bool = False, ubatch: int = DEFAULT_UBATCH
) -> int:
    """Heuristic, in the spirit of llama.cpp's compute buffer sizes (not a measurement).

    A fixed floor, plus f32 activations over the context (cells x embedding length), plus the
    logits of one micro-batch (ubatch x vocabulary, when the vocabulary size is known).

    The term over the context stands for the attention scores (K*Q, n_kv x ubatch x heads in
    f32), which dominate llama.cpp's compute buffer at long contexts. Flash attention computes
    attention in tiles and never materialises them (ikawrakow/ik_llama.cpp#237 and #240 describe
    the K*Q buffer and its removal; tmac1973/llama-toolchest#165 measured 5-6x smaller compute
    buffers with `-fa on`), so with flash attention on that term is left out. `auto` may or may
    not enable it (it depends on the device), so only `on` counts.
    """
    vocab = _meta_int(info.metadata, f"{info.architecture}.vocab_size")
    vocab = vocab or _meta_int(info.metadata, "tokenizer.ggml.tokens") or 0
    activations = 0 if flash_attn else cells * (info.embedding_length or 0) * _F32
    return _COMPUTE_FLOOR_BYTES + activations + ubatch * vocab * _F32


def estimate_gguf(
    info: GgufInfo,
    *,
    ctx_size: int,
    parallel: int = 1,
    kv_dtype_bytes: float | None = None,
    mmproj_path: Path | None = None,
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    flash_attn: str = "auto",
    ubatch: int = DEFAULT_UBATCH,
) -> MemoryEstimate:
    """Estimate the memory llama-server needs for `info` with `-c ctx_size x parallel
    -np parallel` (`ctx_size` is per slot), with its KV cache types and flash attention.

    - weights: the file size (all shards). It includes the header and metadata, a few MB at most,
      so it slightly overstates the tensor data; llama.cpp loads tensors at their stored size.
    - KV cache: for `ctx_size x parallel` cells (one context per slot) in the cache types
      (ggml's block sizes: q8_0 is 34 bytes per 32 values), or at `kv_dtype_bytes` per element.
    - compute buffers: a heuristic (see `_compute_bytes`; smaller with flash attention on); the
      engine corrects the ledger with the measured usage after a load.
    - mmproj: the projector file's size, when one is given.
    - profile: the same by layer (`blk.<i>.*` tensors), when the file has block tensors.

    Raises ValueError when the metadata lacks the architecture keys the KV cache needs.
    """
    if ctx_size <= 0 or parallel <= 0 or (kv_dtype_bytes is not None and kv_dtype_bytes <= 0):
        raise ValueError(
            f"ctx_size, parallel and kv_dtype_bytes must be positive "
            f"(got {ctx_size}, {parallel}, {kv_dtype_bytes})"
        )
    cells = ctx_size * parallel
    mmproj = Path(mmproj_path).stat().st_size if mmproj_path is not None else 0
    kv_layer = _kv_bytes_per_layer(info, cells, cache_type_k, cache_type_v, kv_dtype_bytes)
    layers = info.block_count or 0
    compute = _compute_bytes(info, cells, flash_attn=flash_attn == "on", ubatch=ubatch)
    profile = None
    if info.block_tensor_bytes:
        blocks = info.block_tensor_bytes
        layer_bytes = tuple(blocks[i] if i < len(blocks) else 0 for i in range(layers))
        # Outside the blocks: embeddings, output head, norms, the header, and the projector.
        other = info.size_bytes + mmproj - sum(layer_bytes)
        profile = LayerProfile(layer_bytes, kv_layer, other, compute)
    kv_type = cache_type_k if cache_type_k == cache_type_v else f"{cache_type_k}/{cache_type_v}"
    return MemoryEstimate(
        weights_bytes=info.size_bytes,
        kv_cache_bytes=kv_layer * layers,
        compute_bytes=compute,
        mmproj_bytes=mmproj,
        profile=profile,
        kv_cache_type=kv_type if kv_dtype_bytes is None else None,
        flash_attn=flash_attn,
        ctx_per_slot=ctx_size,
        slots=parallel,
    )


# Bytes per element of the safetensors dtypes (the header's names).
_SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
    "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}
# safetensors refuses headers above 100 MB; so do we, before allocating.
_MAX_SAFETENSORS_HEADER = 100_000_000


# A decoder layer's parameters: `model.layers.<i>.` and the nestings multimodal repos use
# (`model.language_model.layers.<i>.`, `language_model.model.layers.<i>.`); a vision tower's
# layers are not the language model's and stay outside.
_HF_LAYER_RE = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.")


def safetensors_params(path: Path) -> dict[str, int]:
    """Element count per dtype in one .safetensors file, from its header alone."""
    counts: dict[str, int] = {}
    for _name, dtype, numel in safetensors_tensors(path):
        counts[dtype] = counts.get(dtype, 0) + numel
    return counts


def safetensors_tensors(path: Path) -> list[tuple[str, str, int]]:
    """(name, dtype, element count) of each tensor in one .safetensors file, from its header."""
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
    tensors: list[tuple[str, str, int]] = []
    end = 0
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        numel = math.prod(int(d) for d in tensor["shape"])
        tensors.append((name, tensor["dtype"], numel))
        end = max(end, int(tensor["data_offsets"][1]))
    if end > data_bytes:
        raise ValueError(f"{path}: truncated ({data_bytes} data bytes, header says {end})")
    return tensors


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
    blocks: dict[int, int] = {}
    for file in files:
        tensors = safetensors_tensors(file)
        per_dtype: dict[str, int] = {}
        for name, dtype, numel in tensors:
            per_dtype[dtype] = per_dtype.get(dtype, 0) + numel
            if (m := _HF_LAYER_RE.match(name)) is not None:
                blocks[int(m[1])] = blocks.get(int(m[1]), 0) + _stored(dtype, numel, quantize_4bit)
        weights += sum(_stored(d, n, quantize_4bit) for d, n in per_dtype.items())
    config = _read_json(repo_dir / "config.json")
    cells = ctx_size * parallel
    kv = _hf_kv_cache_bytes(config, cells)
    hidden = int(config.get("hidden_size") or 0)
    compute = _COMPUTE_FLOOR_BYTES + cells * hidden * _F32
    profile = None
    layers = int(config.get("num_hidden_layers") or 0) or (max(blocks) + 1 if blocks else 0)
    if blocks and layers:
        layer_bytes = tuple(blocks.get(i, 0) for i in range(layers))
        # kv is 2 x layers x ... (see _hf_kv_cache_bytes), so it divides exactly.
        kv_layer = kv // layers
        # Per-tensor rounding of the 4-bit rule goes to other_bytes, so the sum stays `weights`.
        profile = LayerProfile(layer_bytes, kv_layer, weights - sum(layer_bytes), compute)
        kv = kv_layer * layers
    return MemoryEstimate(weights, kv, compute, 0, profile=profile)


def _stored(dtype: str, numel: int, quantize_4bit: bool) -> int:
    """Bytes of `numel` weights of `dtype`: as stored, or about a quarter of 16-bit in NF4."""
    if quantize_4bit and numel:
        return numel // 2 + numel // 32
    return _SAFETENSORS_DTYPE_BYTES.get(dtype, 2) * numel


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
            opts = memory_options(spec, settings)
            found = estimate_gguf(
                read_gguf_info(spec.path),
                ctx_size=opts.ctx_per_slot,
                parallel=opts.slots,
                mmproj_path=spec.mmproj,
                cache_type_k=opts.cache_type_k,
                cache_type_v=opts.cache_type_v,
                flash_attn=opts.flash_attn,
                ubatch=opts.ubatch,
            )
            extra = draft_bytes(spec, settings)
            if not extra:
                return found
            # The draft lives in the same server, on its first device: "other" bytes of the
            # profile, so the profile still sums to the estimate.
            profile = found.profile
            if profile is not None:
                profile = replace(profile, other_bytes=profile.other_bytes + extra)
            return replace(found, draft_bytes=extra, profile=profile)
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


def estimate_profile(spec: ModelSpec, settings: Settings) -> LayerProfile | None:
    """`spec`'s memory by layer (what a split over devices or a partial offload places), from
    its files' headers; None when they cannot tell (no per-layer tensors, not a GGUF nor a
    safetensors repo). Its `bytes_on_one_device()` equals `estimate_model(...).total_bytes`.

    The profile also rides on the estimate (`MemoryEstimate.profile`), so a caller that keeps
    estimates (the engine's `_estimates`, the front's dispatcher) has it without a second read.
    """
    estimate = estimate_model(spec, settings)
    return estimate.profile if estimate is not None else None


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
