"""Random-weight stand-ins for real models, made where no weights can be downloaded (the GPU check
machine has no network, and the kit it carries must stay under 60 MiB).

Each stand-in has a real architecture (llama), a real tokenizer (the demo model's, carried in the
kit) and random weights, so it loads, fills memory and generates tokens exactly like a trained
model of its size — only its words are nonsense, which no check here reads. Two formats from one
shape: a GGUF (F16) for llama-server and a safetensors repo (F16) for the transformers engine.

    python bench/gpu/standins.py --kit gpu-kit --out DIR --sizes demo,0.5b --formats gguf,st

Only numpy, gguf and safetensors' numpy API are used, so making a 3 B stand-in takes seconds and
no GPU: the weights are slices of one seeded pool of normal values (scaled like an initialised
model, so activations stay finite).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

POOL_VALUES = 1 << 24  # 32 MiB of F16, reused across tensors
KIT_META_GGUF = "demo-meta.gguf"  # the demo GGUF's metadata (tokenizer, template), no tensors
KIT_TOKENIZER_DIR = "demo-tokenizer"  # the demo safetensors repo's tokenizer and config files


@dataclass(frozen=True)
class Shape:
    """A llama-architecture model's dimensions."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 49152  # the demo tokenizer's
    tied: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(GGUF name, HF name, numpy shape) of every tensor."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        out = [("token_embd.weight", "model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            g, f = f"blk.{i}.", f"model.layers.{i}."
            out += [
                (g + "attn_norm.weight", f + "input_layernorm.weight", (h,)),
                (g + "attn_q.weight", f + "self_attn.q_proj.weight", (h, h)),
                (g + "attn_k.weight", f + "self_attn.k_proj.weight", (kv, h)),
                (g + "attn_v.weight", f + "self_attn.v_proj.weight", (kv, h)),
                (g + "attn_output.weight", f + "self_attn.o_proj.weight", (h, h)),
                (g + "ffn_norm.weight", f + "post_attention_layernorm.weight", (h,)),
                (g + "ffn_gate.weight", f + "mlp.gate_proj.weight", (self.ffn, h)),
                (g + "ffn_up.weight", f + "mlp.up_proj.weight", (self.ffn, h)),
                (g + "ffn_down.weight", f + "mlp.down_proj.weight", (h, self.ffn)),
            ]
        out.append(("output_norm.weight", "model.norm.weight", (h,)))
        if not self.tied:
            out.append(("output.weight", "lm_head.weight", (self.vocab, h)))
        return out

    def parameters(self) -> int:
        return sum(int(np.prod(s)) for _, _, s in self.tensors())


# The demo model's own dimensions (SmolLM2-135M), then larger ones of the usual families' shapes
# (0.5 B ~ SmolLM2/Qwen2.5-0.5B, 3 B ~ Llama-3.2-3B, 8 B ~ Llama-3-8B; the demo's vocabulary).
SHAPES: dict[str, Shape] = {
    "demo": Shape(hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536),
    "0.5b": Shape(hidden=1152, layers=28, heads=18, kv_heads=6, ffn=3072),
    "3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192),
    "8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, tied=False),
}


class Pool:
    """Seeded normal values; each tensor is a contiguous run of them (wrapping around)."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.values = (rng.standard_normal(POOL_VALUES, dtype=np.float32) * 0.02).astype(
            np.float16)
        self.offset = 0

    def take(self, shape: tuple[int, ...], norm: bool) -> np.ndarray[Any, Any]:
        if norm:  # RMS norm weights: ones, as an initialised model has
            return np.ones(shape, dtype=np.float32)
        n = int(np.prod(shape))
        reps = -(-(self.offset + n) // POOL_VALUES)
        flat = np.tile(self.values, reps) if reps > 1 else self.values
        out = flat[self.offset:self.offset + n].reshape(shape)
        self.offset = (self.offset + n) % POOL_VALUES
        return np.ascontiguousarray(out)


def _is_norm(gguf_name: str) -> bool:
    return gguf_name.endswith("norm.weight")


def write_gguf(shape: Shape, meta_gguf: Path, out: Path, name: str, ctx: int = 8192) -> Path:
    """A llama GGUF of `shape` with the demo model's tokenizer and chat template."""
    import gguf

    reader = gguf.GGUFReader(meta_gguf)
    writer = gguf.GGUFWriter(out, "llama")
    skip = ("GGUF.", "general.architecture", "general.file_type", "general.name",
            "general.size_label", "llama.")
    for key, field in reader.fields.items():
        if key.startswith(skip):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_name(f"modelyard stand-in {name} (random weights)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_block_count(shape.layers)
    writer.add_context_length(ctx)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    writer.add_rope_dimension_count(shape.head_dim)
    pool = Pool()
    for gname, _, dims in shape.tensors():
        writer.add_tensor(gname, pool.take(dims, _is_norm(gname)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write_safetensors(shape: Shape, tokenizer_dir: Path, out: Path, ctx: int = 8192) -> Path:
    """A transformers llama repo of `shape` (F16), with the demo model's tokenizer files."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy2(f, out / f.name)
    base = json.loads((tokenizer_dir / "config.json").read_text())
    config = {
        **{k: base[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in base},
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": shape.hidden, "intermediate_size": shape.ffn,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab,
        "max_position_embeddings": ctx, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "tie_word_embeddings": shape.tied, "hidden_act": "silu", "torch_dtype": "float16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    pool = Pool()
    tensors = {hname: (pool.take(dims, False).astype(np.float16) if not _is_norm(gname)
                       else np.ones(dims, dtype=np.float16))
               for gname, hname, dims in shape.tensors()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def make(kit: Path, out: Path, size: str, fmt: str) -> Path:
    shape = SHAPES[size]
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "gguf":
        return write_gguf(shape, kit / KIT_META_GGUF, out / f"standin-{size}.F16.gguf", size)
    return write_safetensors(shape, kit / KIT_TOKENIZER_DIR, out / f"standin-{size}-st")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--kit", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sizes", default="demo")
    ap.add_argument("--formats", default="gguf,st")
    args = ap.parse_args(argv)
    for size in args.sizes.split(","):
        for fmt in args.formats.split(","):
            path = make(args.kit, args.out, size, fmt)
            print(f"{size} {fmt}: {SHAPES[size].parameters() / 1e9:.2f} B parameters -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
