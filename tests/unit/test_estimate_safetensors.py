"""store.estimate for safetensors repos, on tiny safetensors files written byte by byte here."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest

from modelyard.config import OpenAIServerModel, Settings
from modelyard.store.estimate import (
    MemoryEstimate,
    estimate_model,
    estimate_safetensors,
    safetensors_params,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

MiB = 2**20
COMPUTE_FLOOR = 64 * MiB
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1, "I8": 1,
               "BOOL": 1, "F8_E4M3": 1}


def write_safetensors(
    path: Path,
    tensors: dict[str, tuple[str, list[int]]],
    metadata: dict[str, str] | None = None,
) -> int:
    """A valid .safetensors file: u64 LE header length, JSON header (space-padded to 8 bytes),
    then each tensor's bytes (zeros) at its data_offsets. Returns the size of the data."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(offset))
    return offset


def write_config(repo: Path, **config: Any) -> None:
    (repo / "config.json").write_text(json.dumps(config))


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home", scan_hf_cache=False)


def spec(path: Path | None, **kw: Any) -> OpenAIServerModel:
    return OpenAIServerModel(id="tiny", argv=["serve", "$path", "--port", "$port"], path=path, **kw)


TENSORS: dict[str, tuple[str, list[int]]] = {
    "embed.weight": ("F16", [32, 16]),
    "layers.0.attn.weight": ("F16", [16, 16]),
    "layers.0.norm.weight": ("F32", [16]),
    "lm_head.weight": ("BF16", [32, 16]),
    "rope.scale": ("F32", []),  # a scalar: one element
    "layers.0.mask": ("BOOL", [4, 4]),
}


def test_safetensors_params_counts_elements_per_dtype(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    write_safetensors(path, TENSORS, metadata={"format": "pt"})
    assert safetensors_params(path) == {
        "F16": 32 * 16 + 16 * 16,
        "F32": 16 + 1,
        "BF16": 32 * 16,
        "BOOL": 16,
    }


def test_safetensors_params_of_an_empty_file_list(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {}, metadata={"format": "pt"})
    assert safetensors_params(path) == {}


@pytest.mark.parametrize(
    ("shards", "expected_weights"),
    [
        pytest.param([{"w": ("F16", [64, 64])}], 64 * 64 * 2, id="one-f16"),
        pytest.param([{"w": ("F32", [64, 64])}], 64 * 64 * 4, id="one-f32"),
        pytest.param(
            [{"a": ("BF16", [10, 10]), "b": ("F64", [3])}, {"c": ("I8", [7]), "d": ("U8", [5])}],
            100 * 2 + 3 * 8 + 7 + 5,
            id="two-shards-mixed-dtypes",
        ),
        pytest.param([TENSORS], None, id="many-dtypes"),
    ],
)
def test_weights_are_the_stored_bytes(
    tmp_path: Path,
    shards: list[dict[str, tuple[str, list[int]]]],
    expected_weights: int | None,
) -> None:
    data = sum(
        write_safetensors(tmp_path / f"model-{i + 1:05}-of-{len(shards):05}.safetensors", shard)
        for i, shard in enumerate(shards)
    )
    (tmp_path / "notes.txt").write_text("not a shard")
    est = estimate_safetensors(tmp_path)
    # Σ numel * dtype size is exactly the tensor data the files hold
    assert est.weights_bytes == data
    if expected_weights is not None:
        assert est.weights_bytes == expected_weights
    # no config.json: no KV cache, and only the compute floor
    assert (est.kv_cache_bytes, est.compute_bytes, est.mmproj_bytes) == (0, COMPUTE_FLOOR, 0)
    assert est.total_bytes == data + COMPUTE_FLOOR


def test_four_bit_is_about_a_quarter_of_f16(tmp_path: Path) -> None:
    write_safetensors(
        tmp_path / "model.safetensors",
        {"a": ("F16", [256, 256]), "b": ("F16", [512, 128]), "c": ("F16", [1000])},
    )
    f16 = estimate_safetensors(tmp_path).weights_bytes
    q4 = estimate_safetensors(tmp_path, quantize_4bit=True).weights_bytes
    assert f16 == (256 * 256 + 512 * 128 + 1000) * 2
    assert q4 == pytest.approx(f16 / 4, rel=0.10)
    assert q4 >= f16 / 4  # errs on the generous side (scales, 16-bit leftovers)


@pytest.mark.parametrize(
    ("config", "ctx_size", "parallel", "expected_kv"),
    [
        pytest.param(
            {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
             "hidden_size": 256, "head_dim": 32},
            1024, 1, 4 * 2 * 32 * 1024 * 2 * 2, id="gqa-with-head-dim",
        ),
        pytest.param(
            {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
             "hidden_size": 256},
            1024, 1, 4 * 2 * (256 // 8) * 1024 * 2 * 2, id="head-dim-from-hidden-size",
        ),
        pytest.param(
            {"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 256},
            1024, 1, 4 * 8 * 32 * 1024 * 2 * 2, id="no-gqa",
        ),
        pytest.param(
            {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
             "head_dim": 64, "hidden_size": 128},
            512, 3, 2 * 1 * 64 * (512 * 3) * 2 * 2, id="parallel-slots",
        ),
        pytest.param(
            {"architectures": ["LlavaForConditionalGeneration"],
             "text_config": {"num_hidden_layers": 6, "num_attention_heads": 4,
                             "num_key_value_heads": 4, "hidden_size": 128}},
            256, 1, 6 * 4 * 32 * 256 * 2 * 2, id="multimodal-text-config",
        ),
        pytest.param({"hidden_size": 128}, 1024, 1, 0, id="config-without-layers"),
        pytest.param(None, 1024, 1, 0, id="no-config"),
    ],
)
def test_kv_cache_from_config(
    tmp_path: Path, config: dict[str, Any] | None, ctx_size: int, parallel: int, expected_kv: int
) -> None:
    write_safetensors(tmp_path / "model.safetensors", {"w": ("F16", [8, 8])})
    if config is not None:
        write_config(tmp_path, **config)
    est = estimate_safetensors(tmp_path, ctx_size=ctx_size, parallel=parallel)
    assert est.kv_cache_bytes == expected_kv
    assert est.weights_bytes == 8 * 8 * 2


def test_compute_grows_with_context_and_hidden_size(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model.safetensors", {"w": ("F16", [8, 8])})
    write_config(tmp_path, num_hidden_layers=2, num_attention_heads=4, hidden_size=128)
    est = estimate_safetensors(tmp_path, ctx_size=2048)
    assert est.compute_bytes == COMPUTE_FLOOR + 2048 * 128 * 4


def test_unreadable_config_counts_as_none(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model.safetensors", {"w": ("F16", [8, 8])})
    (tmp_path / "config.json").write_text("{not json")
    est = estimate_safetensors(tmp_path)
    assert (est.kv_cache_bytes, est.compute_bytes) == (0, COMPUTE_FLOOR)


def test_no_safetensors_in_the_dir(tmp_path: Path) -> None:
    write_config(tmp_path, num_hidden_layers=2, num_attention_heads=4, hidden_size=128)
    with pytest.raises(ValueError, match=r"no \.safetensors files"):
        estimate_safetensors(tmp_path)


# --- malformed files --------------------------------------------------------------------------


def _valid(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"a": ("F16", [64, 64]), "b": ("F32", [64])})
    return path


def _cut_in_header(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:20])


def _too_short(path: Path) -> None:
    path.write_bytes(b"\x10\x00\x00")


def _absurd_length(path: Path) -> None:
    path.write_bytes((2**40).to_bytes(8, "little") + b"{}")


def _just_over_the_limit(path: Path) -> None:
    path.write_bytes((100_000_001).to_bytes(8, "little") + b"{}")


def _not_json(path: Path) -> None:
    path.write_bytes((8).to_bytes(8, "little") + b"\x00\xffGGUF\x01\x02")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_cut_in_header, None),
        (_too_short, "too short"),
        (_absurd_length, "implausible"),
        (_just_over_the_limit, "implausible"),
        (_not_json, None),
    ],
)
def test_malformed_file_is_a_value_error(tmp_path: Path, damage: Any, message: str | None) -> None:
    path = _valid(tmp_path)
    damage(path)
    with pytest.raises(ValueError, match=message):
        safetensors_params(path)
    with pytest.raises(ValueError):
        estimate_safetensors(tmp_path)


def test_file_truncated_in_its_data_is_a_value_error(tmp_path: Path) -> None:
    path = _valid(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError):
        safetensors_params(path)


def test_header_that_is_not_an_object_is_a_value_error(
    tmp_path: Path, settings: Settings
) -> None:
    raw = b"[]      "
    (tmp_path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    assert estimate_model(spec(tmp_path), settings) is None
    with pytest.raises(ValueError):
        safetensors_params(tmp_path / "model.safetensors")


# --- estimate_model on an OpenAI-server model spec --------------------------------------------


def test_estimate_model_of_a_safetensors_repo(tmp_path: Path, settings: Settings) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    data = write_safetensors(repo / "model.safetensors", TENSORS)
    write_config(repo, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 hidden_size=64)
    est = estimate_model(spec(repo), settings)
    ctx = settings.default_ctx_size
    assert est == MemoryEstimate(
        weights_bytes=data,
        kv_cache_bytes=2 * 2 * 16 * ctx * 2 * 2,
        compute_bytes=COMPUTE_FLOOR + ctx * 64 * 4,
        mmproj_bytes=0,
    )
    # the spec's own ctx_size wins over the default
    small = estimate_model(spec(repo, ctx_size=128), settings)
    assert small is not None
    assert small.kv_cache_bytes == 2 * 2 * 16 * 128 * 2 * 2


def test_estimate_model_without_safetensors_is_none_with_a_warning(
    tmp_path: Path, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    write_config(repo, num_hidden_layers=2, num_attention_heads=4, hidden_size=64)
    with caplog.at_level(logging.WARNING, logger="modelyard.store"):
        assert estimate_model(spec(repo), settings) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no memory estimate for tiny" in w and "no .safetensors files" in w
               for w in warnings), warnings


def test_estimate_model_of_a_malformed_repo_is_none(
    tmp_path: Path, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _absurd_length(repo / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="modelyard.store"):
        assert estimate_model(spec(repo), settings) is None
    assert any("implausible" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("where", ["none", "missing", "file"])
def test_estimate_model_without_a_repo_dir_is_none(
    tmp_path: Path, settings: Settings, where: str
) -> None:
    path = {"none": None, "missing": tmp_path / "nope", "file": tmp_path / "w.safetensors"}[where]
    if where == "file":
        write_safetensors(tmp_path / "w.safetensors", {"w": ("F16", [8, 8])})
    assert estimate_model(spec(path), settings) is None


def test_a_transformers_model_counts_every_slot_and_both_caches(
    tmp_path: Path, settings: Settings
) -> None:
    from modelyard.config import TransformersModel

    repo = tmp_path / "repo"
    repo.mkdir()
    data = write_safetensors(repo / "model.safetensors", TENSORS)
    write_config(repo, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 hidden_size=64)
    model = TransformersModel(id="tf", path=repo, ctx_size=256, max_batch_size=4,
                              prefix_cache_tokens=1000, session_cache_tokens=500)
    est = estimate_model(model, settings)
    assert est is not None
    cells = 256 * 4 + 1000 + 500  # all slots at full context, the prefix cache, session pins
    assert est.kv_cache_bytes == 2 * 2 * 16 * cells * 2 * 2
    assert est.weights_bytes == data
    four_bit = estimate_model(model.model_copy(update={"quantize": "q4"}), settings)
    assert four_bit is not None and four_bit.weights_bytes < data
