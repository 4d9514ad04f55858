"""Per-layer estimates (LayerProfile) and the llama.cpp options that change memory: KV cache
types, flash attention, context per slot; on tiny GGUF files written by gguf.GGUFWriter and tiny
safetensors repos written byte by byte (real files, real readers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from modelyard.config import LlamaCppModel, OpenAIServerModel, Settings, TransformersModel
from modelyard.store.estimate import (
    MemoryEstimate,
    cache_type_row_bytes,
    estimate_gguf,
    estimate_model,
    estimate_profile,
)
from modelyard.store.gguf import read_gguf_info

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

SMOLLM = Path.home() / ".cache/modelyard/models/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM_ST = Path.home() / ".cache/modelyard/models/smollm2-135m-instruct-safetensors"

# The tiny model: 2 layers, embedding 64, 4 heads of 16, 2 KV heads -> K and V rows of 32 values.
BLK0 = 64 * 64 * 2  # blk.0.attn_q.weight, f16
BLK1 = 64 * 68 + 64 * 4  # blk.1.attn_q.weight, q8_0 (64 rows of 2 blocks of 34 bytes) + a norm
EMBD = 10 * 64 * 4  # token_embd.weight, f32


def write_layered(path: Path, *, layers: int = 2, vocab: int | None = None) -> Path:
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(layers)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    if vocab is not None:
        writer.add_vocab_size(vocab)
    writer.add_tensor("token_embd.weight", np.ones((10, 64), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((64, 64), dtype=np.float16))
    writer.add_tensor("blk.1.attn_q.weight", np.zeros((64, 68), dtype=np.uint8),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.1.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home", scan_hf_cache=False, default_ctx_size=1000,
                    llama_server_parallel=2)


def test_gguf_tensor_bytes_per_block(tmp_path: Path) -> None:
    info = read_gguf_info(write_layered(tmp_path / "m.gguf"))
    assert info.block_tensor_bytes == (BLK0, BLK1)
    assert info.tensor_bytes == BLK0 + BLK1 + EMBD + 64 * 4


def test_profile_layers_other_and_total(tmp_path: Path) -> None:
    path = write_layered(tmp_path / "m.gguf")
    mmproj = tmp_path / "mmproj-f16.gguf"
    mmproj.write_bytes(b"\0" * 1000)
    est = estimate_gguf(read_gguf_info(path), ctx_size=100, parallel=3, mmproj_path=mmproj)
    prof = est.profile
    assert prof is not None
    assert prof.layer_bytes == (BLK0, BLK1)
    # Outside the blocks: embeddings, the output norm, the file's header and padding, mmproj.
    size = path.stat().st_size
    assert prof.other_bytes == size - BLK0 - BLK1 + 1000
    assert prof.other_bytes >= EMBD + 64 * 4 + 1000
    # f16 K and V rows of 2 heads x 16 = 32 values, 300 cells
    assert prof.kv_bytes_per_layer == 300 * (32 * 2 + 32 * 2)
    assert prof.compute_bytes_per_device == est.compute_bytes
    assert prof.bytes_on_one_device() == est.total_bytes


def test_block_count_beyond_the_tensors_counts_empty_layers(tmp_path: Path) -> None:
    est = estimate_gguf(read_gguf_info(write_layered(tmp_path / "m.gguf", layers=3)),
                        ctx_size=10)
    assert est.profile is not None and est.profile.layer_bytes == (BLK0, BLK1, 0)
    assert est.profile.bytes_on_one_device() == est.total_bytes


def test_no_block_tensors_no_profile(tmp_path: Path) -> None:
    writer = GGUFWriter(tmp_path / "flat.gguf", "llama")
    for add, n in ((writer.add_block_count, 2), (writer.add_embedding_length, 64),
                   (writer.add_head_count, 4)):
        add(n)
    writer.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    est = estimate_gguf(read_gguf_info(tmp_path / "flat.gguf"), ctx_size=10)
    assert est.profile is None
    assert est.total_bytes > 0


@pytest.mark.parametrize(
    ("k", "v", "row_k", "row_v"),
    [
        ("f16", "f16", 64, 64),  # 32 values x 2 bytes
        ("q8_0", "q8_0", 34, 34),  # one block of 32 values in 34 bytes
        ("q4_0", "q4_0", 18, 18),  # 32 values in 18 bytes
        ("q8_0", "f16", 34, 64),
        ("f32", "q5_1", 128, 24),
        ("iq4_nl", "q4_1", 18, 20),
        ("bf16", "q5_0", 64, 22),
    ],
)
def test_kv_per_layer_by_cache_type(
    tmp_path: Path, k: str, v: str, row_k: int, row_v: int
) -> None:
    info = read_gguf_info(write_layered(tmp_path / "m.gguf"))
    est = estimate_gguf(info, ctx_size=512, parallel=2, cache_type_k=k, cache_type_v=v)
    assert est.profile is not None
    assert est.profile.kv_bytes_per_layer == 1024 * (row_k + row_v)
    assert est.kv_cache_bytes == 2 * 1024 * (row_k + row_v)
    assert est.kv_cache_type == (k if k == v else f"{k}/{v}")


def test_row_bytes_round_up_to_whole_blocks() -> None:
    assert cache_type_row_bytes("q8_0", 64) == 68
    assert cache_type_row_bytes("q8_0", 33) == 68
    assert cache_type_row_bytes("Q4_0", 128) == 72
    assert cache_type_row_bytes("f16", 7) == 14
    assert cache_type_row_bytes("no-such-type", 7) == 14  # llama-server's default, f16


def test_flash_attention_drops_the_scores_term(tmp_path: Path) -> None:
    info = read_gguf_info(write_layered(tmp_path / "m.gguf", vocab=32000))
    off = estimate_gguf(info, ctx_size=4096, parallel=4, flash_attn="off").compute_bytes
    auto = estimate_gguf(info, ctx_size=4096, parallel=4).compute_bytes
    on = estimate_gguf(info, ctx_size=4096, parallel=4, flash_attn="on").compute_bytes
    assert off == auto  # auto may not enable it: counted as off, the generous side
    assert off - on == 4096 * 4 * 64 * 4  # cells x embedding x f32
    assert on == 64 * 2**20 + 512 * 32000 * 4  # the floor and one micro-batch of logits
    ub = estimate_gguf(info, ctx_size=4096, flash_attn="on", ubatch=128).compute_bytes
    assert ub == 64 * 2**20 + 128 * 32000 * 4


def llama(path: Path, **kw: Any) -> LlamaCppModel:
    return LlamaCppModel(id="m", path=path, **kw)


def test_fields_enter_the_estimate(tmp_path: Path, settings: Settings) -> None:
    path = write_layered(tmp_path / "m.gguf")
    plain = estimate_model(llama(path), settings)
    est = estimate_model(llama(path, cache_type_k="q8_0", cache_type_v="q4_0", flash_attn="on"),
                         settings)
    assert plain is not None and est is not None
    cells = 1000 * 2  # default_ctx_size x llama_server_parallel
    assert plain.kv_cache_bytes == 2 * cells * (64 + 64)
    assert est.kv_cache_bytes == 2 * cells * (34 + 18)
    assert plain.compute_bytes - est.compute_bytes == cells * 64 * 4
    assert est.to_json() == {
        "weights_bytes": est.weights_bytes, "kv_cache_bytes": est.kv_cache_bytes,
        "compute_bytes": est.compute_bytes, "mmproj_bytes": 0, "total_bytes": est.total_bytes,
        "kv_cache_type": "q8_0/q4_0", "flash_attn": "on", "ctx_per_slot": 1000, "slots": 2,
        "layers": 2,
    }


@pytest.mark.parametrize(
    ("extra", "kv_row", "flash"),
    [
        (["-ctk", "q8_0", "-ctv", "q8_0"], 34 + 34, "auto"),
        (["--cache-type-k=q4_0", "--cache-type-v", "q4_0", "-fa", "on"], 18 + 18, "on"),
        (["--temp", "0.7", "-fa", "--cache-type-k", "q8_0"], 34 + 64, "on"),  # bare -fa: on
        (["--flash-attn=off"], 64 + 64, "off"),
    ],
)
def test_extra_args_are_counted(
    tmp_path: Path, settings: Settings, extra: list[str], kv_row: int, flash: str
) -> None:
    est = estimate_model(llama(write_layered(tmp_path / "m.gguf"), extra_args=extra), settings)
    assert est is not None
    assert est.kv_cache_bytes == 2 * 2000 * kv_row
    assert est.flash_attn == flash


def test_extra_args_win_over_fields(tmp_path: Path, settings: Settings) -> None:
    # llama-server takes an option's last occurrence; extra_args come after the fields' flags.
    spec = llama(write_layered(tmp_path / "m.gguf"), cache_type_k="q4_0", cache_type_v="q4_0",
                 flash_attn="on", extra_args=["-ctk", "f16", "-fa", "off"])
    est = estimate_model(spec, settings)
    assert est is not None
    assert est.kv_cache_bytes == 2 * 2000 * (64 + 18)
    assert (est.kv_cache_type, est.flash_attn) == ("f16/q4_0", "off")


def test_context_and_slots_from_extra_args(tmp_path: Path, settings: Settings) -> None:
    path = write_layered(tmp_path / "m.gguf")
    # -np 4: the default argv's --ctx-size (1000 x 2) is shared by 4 slots of 500
    est = estimate_model(llama(path, extra_args=["-np", "4"]), settings)
    assert est is not None and (est.ctx_per_slot, est.slots) == (500, 4)
    assert est.kv_cache_bytes == 2 * 2000 * 128
    # -c 8000: the total the slots share
    est = estimate_model(llama(path, extra_args=["--ctx-size", "8000"]), settings)
    assert est is not None and (est.ctx_per_slot, est.slots) == (4000, 2)
    assert est.kv_cache_bytes == 2 * 8000 * 128


def test_custom_argv_is_read(tmp_path: Path, settings: Settings) -> None:
    spec = llama(write_layered(tmp_path / "m.gguf"), ctx_size=300,
                 argv=["$llama_server", "-m", "$path", "-c", "$ctx", "-np", "1", "-ctk", "q8_0"])
    est = estimate_model(spec, settings)
    assert est is not None and (est.ctx_per_slot, est.slots) == (300, 1)
    assert est.kv_cache_bytes == 2 * 300 * (34 + 64)


def test_estimate_profile_agrees_with_estimate_model(tmp_path: Path, settings: Settings) -> None:
    spec = llama(write_layered(tmp_path / "m.gguf"), cache_type_k="q8_0", flash_attn="on")
    est, prof = estimate_model(spec, settings), estimate_profile(spec, settings)
    assert est is not None and prof is not None
    assert prof == est.profile
    assert prof.bytes_on_one_device() == est.total_bytes


def test_no_profile_when_files_cannot_tell(tmp_path: Path, settings: Settings) -> None:
    assert estimate_profile(llama(tmp_path / "absent.gguf"), settings) is None
    service = OpenAIServerModel(id="s", argv=["serve"], path=None)
    assert estimate_profile(service, settings) is None


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    sizes = {"F16": 2, "BF16": 2, "F32": 4}
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        nbytes = int(np.prod(shape)) * sizes[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(offset))


def hf_repo(repo: Path) -> Path:
    repo.mkdir()
    write_safetensors(repo / "model-00001-of-00002.safetensors", {
        "model.embed_tokens.weight": ("F16", [100, 32]),
        "model.layers.0.self_attn.q_proj.weight": ("F16", [32, 32]),
        "model.layers.0.input_layernorm.weight": ("F32", [32]),
    })
    write_safetensors(repo / "model-00002-of-00002.safetensors", {
        "model.layers.1.self_attn.q_proj.weight": ("BF16", [32, 64]),
        "model.norm.weight": ("F32", [32]),
        "model.vision_tower.layers.0.weight": ("F16", [32, 32]),  # not a decoder layer
    })
    (repo / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 32,
    }))
    return repo


def test_safetensors_profile_by_layer_name(tmp_path: Path, settings: Settings) -> None:
    repo = hf_repo(tmp_path / "repo")
    spec = OpenAIServerModel(id="v", argv=["vllm", "serve", "$path"], path=repo, ctx_size=256)
    est = estimate_model(spec, settings)
    assert est is not None and est.profile is not None
    prof = est.profile
    assert prof.layer_bytes == (32 * 32 * 2 + 32 * 4, 32 * 64 * 2)
    assert prof.other_bytes == 100 * 32 * 2 + 32 * 4 + 32 * 32 * 2
    # 2 (K, V) x 2 kv heads x head dim 8 x 256 cells x 2 bytes
    assert prof.kv_bytes_per_layer == 2 * 2 * 8 * 256 * 2
    assert prof.bytes_on_one_device() == est.total_bytes


@pytest.mark.parametrize("quantize", ["no", "q4"])
def test_transformers_profile_agrees_with_its_estimate(
    tmp_path: Path, settings: Settings, quantize: str
) -> None:
    spec = TransformersModel(id="t", path=hf_repo(tmp_path / "repo"), quantize=quantize)
    est = estimate_model(spec, settings)
    prof = estimate_profile(spec, settings)
    assert est is not None and prof is not None
    assert prof.layers == 2
    assert prof.bytes_on_one_device() == est.total_bytes


def test_safetensors_without_layers_has_no_profile(tmp_path: Path, settings: Settings) -> None:
    (tmp_path / "r").mkdir()
    write_safetensors(tmp_path / "r" / "model.safetensors", {"w": ("F16", [4, 4])})
    spec = OpenAIServerModel(id="v", argv=["x"], path=tmp_path / "r")
    est = estimate_model(spec, settings)
    assert est is not None and est.profile is None


def test_new_fields_do_not_change_equality() -> None:
    a = MemoryEstimate(1, 2, 3, 4)
    b = MemoryEstimate(1, 2, 3, 4, kv_cache_type="q8_0", slots=2)
    assert a == b
    assert a.to_json() == {"weights_bytes": 1, "kv_cache_bytes": 2, "compute_bytes": 3,
                           "mmproj_bytes": 4, "total_bytes": 10}


@pytest.mark.skipif(not SMOLLM.is_file(), reason="SmolLM2 demo model not downloaded")
def test_demo_gguf_profile_sums_to_its_estimate(settings: Settings) -> None:
    for kw in ({}, {"cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on"}):
        spec = llama(SMOLLM, **kw)
        est = estimate_model(spec, settings)
        prof = estimate_profile(spec, settings)
        assert est is not None and prof is not None
        assert prof.layers == 30
        assert prof.bytes_on_one_device() == est.total_bytes
        # the blocks hold most of the weights; the rest is the (tied) embedding and norms
        assert 0.5 * est.weights_bytes < sum(prof.layer_bytes) < est.weights_bytes
    # q8_0: 3 KV heads x 64 = 192 values = 6 blocks of 34 bytes per row, against 384 in f16
    assert prof.kv_bytes_per_layer == 2000 * (204 + 204)


@pytest.mark.skipif(not SMOLLM_ST.is_dir(), reason="demo safetensors repo not downloaded")
def test_demo_safetensors_profile_sums_to_its_estimate(settings: Settings) -> None:
    spec = TransformersModel(id="t", path=SMOLLM_ST, quantize="no")
    est = estimate_model(spec, settings)
    prof = estimate_profile(spec, settings)
    assert est is not None and prof is not None
    assert prof.layers == 30
    assert prof.bytes_on_one_device() == est.total_bytes
