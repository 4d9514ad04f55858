"""store.estimate on tiny GGUF files written with gguf.GGUFWriter (real files, real reader)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from modelyard.store.estimate import MemoryEstimate, estimate_gguf, gib
from modelyard.store.gguf import GgufInfo, read_gguf_info

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

SMOLLM = Path.home() / ".cache/modelyard/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def write_model(
    path: Path,
    *,
    layers: int | None = 30,
    embd: int | None = 576,
    heads: int | None = 9,
    kv_heads: int | None = 3,
    key_len: int | None = None,
    value_len: int | None = None,
    context_length: int | None = None,
) -> GgufInfo:
    """A small llama GGUF carrying just the keys the estimate reads, and one tensor."""
    writer = GGUFWriter(path, "llama")
    if context_length is not None:
        writer.add_context_length(context_length)
    if layers is not None:
        writer.add_block_count(layers)
    if embd is not None:
        writer.add_embedding_length(embd)
    if heads is not None:
        writer.add_head_count(heads)
    if kv_heads is not None:
        writer.add_head_count_kv(kv_heads)
    if key_len is not None:
        writer.add_key_length(key_len)
    if value_len is not None:
        writer.add_value_length(value_len)
    writer.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_gguf_info(path)


def test_kv_cache_formula_exact(tmp_path: Path) -> None:
    info = write_model(tmp_path / "m.gguf", embd=576, heads=9, kv_heads=3)  # head dim 64
    est = estimate_gguf(info, ctx_size=2048, parallel=4)
    assert est.kv_cache_bytes == 2 * 30 * 3 * 64 * 8192 * 2
    assert est.weights_bytes == info.size_bytes == (tmp_path / "m.gguf").stat().st_size
    assert est.mmproj_bytes == 0
    assert est.compute_bytes > 0
    assert est.total_bytes == (
        est.weights_bytes + est.kv_cache_bytes + est.compute_bytes + est.mmproj_bytes
    )


def test_parallel_multiplies_kv_and_dtype_scales(tmp_path: Path) -> None:
    info = write_model(tmp_path / "m.gguf")
    one = estimate_gguf(info, ctx_size=4096)
    four = estimate_gguf(info, ctx_size=4096, parallel=4)
    assert four.kv_cache_bytes == 4 * one.kv_cache_bytes
    assert estimate_gguf(info, ctx_size=16384).kv_cache_bytes == four.kv_cache_bytes
    q8 = estimate_gguf(info, ctx_size=4096, kv_dtype_bytes=1.0)
    assert q8.kv_cache_bytes * 2 == one.kv_cache_bytes


def test_key_and_value_lengths_override_head_dim(tmp_path: Path) -> None:
    info = write_model(
        tmp_path / "m.gguf", embd=4096, heads=32, kv_heads=8, key_len=192, value_len=128
    )
    est = estimate_gguf(info, ctx_size=1000)
    assert est.kv_cache_bytes == 30 * 8 * (192 + 128) * 1000 * 2


def test_key_lengths_suffice_without_embedding_length(tmp_path: Path) -> None:
    info = write_model(tmp_path / "m.gguf", embd=None, key_len=64, value_len=64)
    assert estimate_gguf(info, ctx_size=100).kv_cache_bytes == 2 * 30 * 3 * 64 * 100 * 2


def test_head_count_kv_falls_back_to_head_count(tmp_path: Path) -> None:
    info = write_model(tmp_path / "m.gguf", embd=512, heads=8, kv_heads=None)
    assert info.head_count_kv is None
    est = estimate_gguf(info, ctx_size=256)
    assert est.kv_cache_bytes == 2 * 30 * 8 * 64 * 256 * 2


def test_mmproj_size_added(tmp_path: Path) -> None:
    info = write_model(tmp_path / "m.gguf")
    mmproj = tmp_path / "mmproj-f16.gguf"
    mmproj.write_bytes(b"\0" * 12345)
    without = estimate_gguf(info, ctx_size=512)
    est = estimate_gguf(info, ctx_size=512, mmproj_path=mmproj)
    assert est.mmproj_bytes == 12345
    assert est.total_bytes == without.total_bytes + 12345


@pytest.mark.parametrize(
    ("kwargs", "missing"),
    [
        ({"layers": None}, "llama.block_count"),
        ({"heads": None}, "llama.attention.head_count"),
        ({"embd": None}, "llama.embedding_length"),
    ],
)
def test_missing_architecture_keys_raise(
    tmp_path: Path, kwargs: dict[str, int | None], missing: str
) -> None:
    info = write_model(tmp_path / "m.gguf", **kwargs)
    with pytest.raises(ValueError, match=missing):
        estimate_gguf(info, ctx_size=512)


def test_rejects_non_positive_sizes(tmp_path: Path) -> None:
    info = write_model(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="positive"):
        estimate_gguf(info, ctx_size=0)
    with pytest.raises(ValueError, match="positive"):
        estimate_gguf(info, ctx_size=512, parallel=0)


def test_compute_grows_with_context_and_vocab(tmp_path: Path) -> None:
    info = write_model(tmp_path / "m.gguf")
    small = estimate_gguf(info, ctx_size=512).compute_bytes
    assert estimate_gguf(info, ctx_size=8192).compute_bytes > small
    with_vocab = replace(info, metadata={**info.metadata, "llama.vocab_size": 32000})
    assert estimate_gguf(with_vocab, ctx_size=512).compute_bytes > small


def test_json_and_gib() -> None:
    est = MemoryEstimate(weights_bytes=1, kv_cache_bytes=2, compute_bytes=3, mmproj_bytes=4)
    assert est.to_json() == {
        "weights_bytes": 1,
        "kv_cache_bytes": 2,
        "compute_bytes": 3,
        "mmproj_bytes": 4,
        "total_bytes": 10,
    }
    assert gib(3 * 1024**3 // 2) == "1.50 GiB"


@pytest.mark.skipif(not SMOLLM.is_file(), reason="SmolLM2 demo model not downloaded")
def test_smollm2_estimate_is_sane() -> None:
    est = estimate_gguf(read_gguf_info(SMOLLM), ctx_size=4096, parallel=4)
    assert 90e6 < est.weights_bytes < 110e6
    assert est.kv_cache_bytes == 2 * 30 * 3 * 64 * 16384 * 2
    assert 64 * 1024**2 <= est.compute_bytes < 1024**3
    assert 0.4e9 < est.total_bytes < 2e9
