"""store.gguf on tiny GGUF files written with gguf.GGUFWriter (real files, real reader)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter, LlamaFileType

from modelyard.store.gguf import (
    MAX_ARRAY_ITEMS,
    GgufError,
    SplitName,
    _MetadataReader,
    file_type_name,
    is_mmproj,
    parse_split_name,
    quant_tag_from_filename,
    read_gguf_info,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
N_TOKENS = MAX_ARRAY_ITEMS + 36
# token_embd (100 x 16) + two blocks of attn_q (16 x 16) + output_norm (16)
PARAMS = N_TOKENS * 16 + 2 * 16 * 16 + 16


def write_llama(
    path: Path,
    *,
    file_type: int | None = LlamaFileType.MOSTLY_F16,
    arch: str | None = "llama",
    split_max_tensors: int = 0,
) -> Path:
    """A small but well-formed llama GGUF: the usual llama.* keys, a tokenizer, 4 tensors."""
    writer = GGUFWriter(path, arch or "llama", split_max_tensors=split_max_tensors)
    if arch is None:
        del writer.kv_data[0]["general.architecture"]
    writer.add_name("Tiny Llama")
    if file_type is not None:
        writer.add_file_type(int(file_type))
    writer.add_languages(["en"])
    writer.add_context_length(2048)
    writer.add_embedding_length(16)
    writer.add_block_count(2)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_add_bos_token(False)
    writer.add_bos_token_id(1)
    writer.add_token_list([f"tok{i}" for i in range(N_TOKENS)])
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_tensor("token_embd.weight", np.zeros((N_TOKENS, 16), dtype=np.float16))
    for block in range(2):
        writer.add_tensor(f"blk.{block}.attn_q.weight", np.ones((16, 16), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_reads_llama_metadata(tmp_path: Path) -> None:
    path = write_llama(tmp_path / "tiny-llama.F16.gguf")
    info = read_gguf_info(path)
    assert info.path == path
    assert info.size_bytes == path.stat().st_size
    assert info.architecture == "llama"
    assert info.name == "Tiny Llama"
    assert info.file_type == "F16"
    assert info.parameter_count == PARAMS
    assert (info.context_length, info.embedding_length, info.block_count) == (2048, 16, 2)
    assert (info.head_count, info.head_count_kv) == (4, 2)
    assert info.chat_template == CHAT_TEMPLATE


def test_metadata_keeps_scalars_and_short_arrays_and_summarises_long_ones(tmp_path: Path) -> None:
    meta = read_gguf_info(write_llama(tmp_path / "m.gguf")).metadata
    assert meta["general.architecture"] == "llama"
    assert meta["llama.context_length"] == 2048
    assert meta["llama.attention.layer_norm_rms_epsilon"] == 1e-05  # float32 shown shortest
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["general.languages"] == ["en"]
    assert meta["tokenizer.ggml.tokens"] == N_TOKENS  # the length, not 100 strings
    assert not any(key.startswith("GGUF.") for key in meta)


def test_fast_reader_agrees_with_stock_reader(tmp_path: Path) -> None:
    # The reader subclass skips long arrays; the layout it finds must be the stock one.
    path = write_llama(tmp_path / "m.gguf")
    stock, fast = GGUFReader(path), _MetadataReader(path)
    assert list(fast.fields) == list(stock.fields)
    assert fast.data_offset == stock.data_offset
    assert [(t.name, t.data_offset, t.n_elements) for t in fast.tensors] == [
        (t.name, t.data_offset, t.n_elements) for t in stock.tensors
    ]


def test_truncated_inside_a_long_array_raises(tmp_path: Path) -> None:
    whole = write_llama(tmp_path / "whole.gguf").read_bytes()
    cut = whole.index(b"tok50")  # in the middle of the token list
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[:cut])
    with pytest.raises(GgufError, match=r"cut\.gguf"):
        read_gguf_info(path)


def test_info_is_frozen(tmp_path: Path) -> None:
    info = read_gguf_info(write_llama(tmp_path / "m.gguf"))
    with pytest.raises(AttributeError):
        info.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("raw", "name"),
    [
        (0, "F32"),
        (1, "F16"),
        (3, "Q4_1"),
        (15, "Q4_K_M"),
        (23, "IQ3_XXS"),
        (32, "BF16"),
        (15 | 1024, "Q4_K_M"),  # llama.cpp's "guessed" flag
        (1024, "F32"),  # llama.cpp writes a guessed all-F32 file as 0 | 1024
        (9999, None),
    ],
)
def test_file_type_name(raw: int, name: str | None) -> None:
    assert file_type_name(raw) == name


def test_file_type_written_as_quant_is_reported(tmp_path: Path) -> None:
    path = write_llama(tmp_path / "m.gguf", file_type=LlamaFileType.MOSTLY_Q4_K_M)
    assert read_gguf_info(path).file_type == "Q4_K_M"


def test_file_type_falls_back_to_filename_then_tensor_types(tmp_path: Path) -> None:
    tagged = write_llama(tmp_path / "m-Q5_K_S.gguf", file_type=None)
    assert read_gguf_info(tagged).file_type == "Q5_K_S"
    untagged = write_llama(tmp_path / "model.gguf", file_type=None)
    assert read_gguf_info(untagged).file_type == "F16"  # token_embd holds most matrix bytes


def test_missing_architecture_is_an_error(tmp_path: Path) -> None:
    path = write_llama(tmp_path / "noarch.gguf", arch=None)
    with pytest.raises(GgufError, match=r"noarch\.gguf.*general.architecture"):
        read_gguf_info(path)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"GG",
        b"<!DOCTYPE html><html><body>404 Not Found</body></html>",
        b"\x00" * 4096,
        # valid magic and version, then counts far beyond what the file holds
        b"GGUF" + (3).to_bytes(4, "little") + (10**9).to_bytes(8, "little") + bytes(8),
        # valid header, then a key whose type is not a GGUF type
        b"GGUF"
        + (3).to_bytes(4, "little")
        + (0).to_bytes(8, "little")
        + (1).to_bytes(8, "little")
        + (3).to_bytes(8, "little")
        + b"abc"
        + (999).to_bytes(4, "little")
        + bytes(16),
    ],
    ids=["empty", "short", "html", "zeros", "absurd-counts", "bad-value-type"],
)
def test_corrupt_files_raise_gguf_error_naming_the_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(GgufError, match=r"broken\.gguf") as excinfo:
        read_gguf_info(path)
    assert isinstance(excinfo.value, ValueError)


def test_truncated_download_raises(tmp_path: Path) -> None:
    whole = write_llama(tmp_path / "whole.gguf").read_bytes()
    for cut in (30, 200, len(whole) // 2, len(whole) - 8):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(whole[:cut])
        with pytest.raises(GgufError, match=rf"cut{cut}\.gguf"):
            read_gguf_info(path)


def test_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(GgufError, match=r"nope\.gguf"):
        read_gguf_info(tmp_path / "nope.gguf")


def test_split_model_sums_all_shards(tmp_path: Path) -> None:
    write_llama(tmp_path / "big.gguf", split_max_tensors=2)
    shards = sorted(tmp_path.glob("big-*-of-*.gguf"))
    assert [s.name for s in shards] == ["big-00001-of-00002.gguf", "big-00002-of-00002.gguf"]
    info = read_gguf_info(shards[0])
    assert info.parameter_count == PARAMS
    assert info.size_bytes == sum(s.stat().st_size for s in shards)
    assert info.architecture == "llama"
    assert info.metadata["split.count"] == 2


def test_split_model_later_shard_or_missing_shard_is_an_error(tmp_path: Path) -> None:
    write_llama(tmp_path / "big.gguf", split_max_tensors=2)
    with pytest.raises(GgufError, match=r"open the first shard"):
        read_gguf_info(tmp_path / "big-00002-of-00002.gguf")
    (tmp_path / "big-00002-of-00002.gguf").unlink()
    with pytest.raises(GgufError, match=r"missing big-00002-of-00002\.gguf"):
        read_gguf_info(tmp_path / "big-00001-of-00002.gguf")


@pytest.mark.parametrize(
    ("name", "tag"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"),
        ("model-q4_k_m.gguf", "Q4_K_M"),
        ("x-IQ3_XXS.gguf", "IQ3_XXS"),
        ("x-IQ2_XS.gguf", "IQ2_XS"),
        ("x-iq4_nl.gguf", "IQ4_NL"),
        ("f16", "F16"),
        ("llama-3-8b-BF16.gguf", "BF16"),
        ("qwen2.5-7b-instruct-fp16.gguf", "F16"),
        ("mistral-7b-instruct-v0.2.Q8_0.gguf", "Q8_0"),
        ("Qwen3-30B-A3B-UD-Q4_K_XL-00001-of-00002.gguf", "Q4_K_XL"),
        ("phi-3-mini.Q4_0_4_4.gguf", "Q4_0_4_4"),
        ("gpt-oss-20b-MXFP4.gguf", "MXFP4"),
        ("llama-f16-to-Q6_K.gguf", "Q6_K"),
        ("SmolLM2-135M-Instruct.gguf", None),
        ("qwen2-vl.gguf", None),
        ("mmproj-model.gguf", None),
    ],
)
def test_quant_tag_from_filename(name: str, tag: str | None) -> None:
    assert quant_tag_from_filename(name) == tag


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("mmproj-model-f16.gguf", True),
        ("Qwen2-VL-7B-MMPROJ-F16.gguf", True),
        ("llava-v1.6.mmproj.Q8_0.gguf", True),
        ("llava-v1.6.Q4_K_M.gguf", False),
    ],
)
def test_is_mmproj(name: str, expected: bool) -> None:
    assert is_mmproj(Path("/models") / name) is expected


def test_parse_split_name() -> None:
    assert parse_split_name("a-b-00001-of-00003.gguf") == SplitName("a-b", 1, 3)
    assert parse_split_name("A-00003-OF-00003.GGUF") == SplitName("A", 3, 3)
    assert parse_split_name("a-00004-of-00003.gguf") is None
    assert parse_split_name("a-0001-of-0003.gguf") is None
    assert parse_split_name("a.gguf") is None
