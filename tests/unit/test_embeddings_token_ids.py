"""Token ids as an embeddings `input` (issue 32 item 1): their shapes, cl100k_base decoding from
the shipped encoding, and the front's routes deciding by the model's `token_ids` setting (over
test_embeddings_front.py's stub state, which records what would be relayed)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tiktoken
from tests.support import ROOT
from tests.unit.test_embeddings_front import OK, StubState, client_for

from modelyard.config import LlamaCppModel, TransformersModel
from modelyard.embeddings_shapes import (
    MAX_INPUTS,
    InvalidParams,
    openai_body,
    parse_ollama_embed,
    parse_openai_request,
)
from modelyard.front.api.token_ids import (
    ENCODING_FILE,
    ENCODING_SHA256,
    EncodingFileCorrupt,
    InvalidTokenId,
    cl100k_base,
    decode_cl100k,
    load_cl100k_base,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TEXTS = ["hello world", "Ünïcödé, emoji 🙂 and\nnew lines  ", "def f(x):\n    return x ** 2"]
# tiktoken's download cache names a file by the sha1 of its URL (tiktoken/load.py).
BLOB = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


# ---- shapes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "ids"),
    [
        ([15339, 1917], [[15339, 1917]]),
        ([[15339, 1917], [9906]], [[15339, 1917], [9906]]),
        ([0], [[0]]),
        (list(range(MAX_INPUTS + 5)), [list(range(MAX_INPUTS + 5))]),  # one long input
    ],
)
def test_token_arrays_parse(value: Any, ids: list[list[int]]) -> None:
    req = parse_openai_request({"model": "m", "input": value})
    assert (req.texts, req.token_ids) == ([], ids)
    assert openai_body(req)["input"] == ids
    assert parse_ollama_embed({"model": "m", "input": value}).token_ids == ids


def test_text_parses_as_before() -> None:
    req = parse_openai_request({"model": "m", "input": ["a", "b"]})
    assert (req.texts, req.token_ids) == (["a", "b"], None)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ([1, "a"], "input[1] must be a token id (an integer >= 0), not str"),
        ([1, 2.5], "input[1] must be a token id (an integer >= 0), not float"),
        ([1, True], "input[1] must be a token id (an integer >= 0), not bool"),
        ([1, [2]], "input[1] must be a token id"),
        ([-1], "input[0] must be a token id (an integer >= 0), not -1"),
        ([[1], "a"], "input[1] must be a list of token ids, as input[0] is, not str"),
        ([[1], 2], "input[1] must be a list of token ids"),
        ([[1, "x"]], "input[0][1] must be a token id"),
        ([[[1]]], "input[0][0] must be a token id (an integer >= 0), not list"),
        ([[1], []], "input[1] must not be an empty list of token ids"),
        ([[]], "input[0] must not be an empty list of token ids"),
        ([[1]] * (MAX_INPUTS + 1), f"at most {MAX_INPUTS}"),
    ],
)
def test_bad_token_arrays_are_400s_on_input(value: Any, words: str) -> None:
    for parse in (parse_openai_request, parse_ollama_embed):
        with pytest.raises(InvalidParams) as caught:
            parse({"model": "m", "input": value})
        assert words in str(caught.value)
        assert caught.value.status == 400 and caught.value.param == "input"


# ---- cl100k_base from the shipped file ----------------------------------------------------------


def test_the_shipped_file_is_openai_s_cl100k_base() -> None:
    assert hashlib.sha256(ENCODING_FILE.read_bytes()).hexdigest() == ENCODING_SHA256


@pytest.fixture(scope="module")
def tiktoken_own(tmp_path_factory: pytest.TempPathFactory) -> tiktoken.Encoding:
    """tiktoken's own cl100k_base (as LangChain gets it), read from a copy of the shipped file
    where tiktoken's cache looks for it: no download."""
    cache = tmp_path_factory.mktemp("tiktoken-cache")
    shutil.copy(ENCODING_FILE, cache / hashlib.sha1(BLOB.encode()).hexdigest())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        return tiktoken.get_encoding("cl100k_base")


def test_ours_is_the_encoding_tiktoken_builds(tiktoken_own: tiktoken.Encoding) -> None:
    ours = cl100k_base()
    assert ours.n_vocab == tiktoken_own.n_vocab == 100277
    assert ours._special_tokens == tiktoken_own._special_tokens
    for text in TEXTS:
        assert ours.encode(text) == tiktoken_own.encode(text)
    assert decode_cl100k([tiktoken_own.encode(t) for t in TEXTS]) == TEXTS


def test_the_encoding_is_built_once() -> None:
    assert cl100k_base() is cl100k_base()


@pytest.mark.parametrize("bad", [100261, 100275, 100277, 2**31, 2**40])
def test_an_id_outside_the_vocabulary_is_a_400(bad: int) -> None:
    with pytest.raises(InvalidTokenId) as caught:
        decode_cl100k([[15339], [15339, bad, 1917]])
    err = caught.value
    assert err.status == 400 and err.code == "invalid_token_id" and err.param == "input"
    assert f"input[1] holds token id {bad}" in str(err)
    body = err.openai_body()["error"]
    assert (body["type"], body["code"], body["param"]) == (
        "invalid_request_error", "invalid_token_id", "input")


def test_a_corrupt_encoding_file_is_refused(tmp_path: Path) -> None:
    data = bytearray(ENCODING_FILE.read_bytes())
    data[100] ^= 1
    (tmp_path / "cl100k_base.tiktoken").write_bytes(data)
    with pytest.raises(EncodingFileCorrupt, match="sha256"):
        load_cl100k_base(tmp_path / "cl100k_base.tiktoken")


def test_text_requests_never_load_tiktoken() -> None:
    # The plain-text path costs nothing more: tiktoken is imported by the first token ids only.
    code = """
import sys
from starlette.testclient import TestClient
from tests.support import ROOT
from tests.unit.test_embeddings_front import OK, StubState, client_for
state = StubState(OK)
client_for(state).post("/v1/embeddings", json={"model": "m", "input": "hi"})
client_for(state).post("/api/embed", json={"model": "m", "input": ["hi"]})
assert len(state.sent) == 2
print("tiktoken" in sys.modules)
client_for(state).post("/v1/embeddings", json={"model": "m", "input": [15339]})
print("tiktoken" in sys.modules)
"""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env, cwd=ROOT, timeout=50)
    assert out.stdout.split() == ["False", "True"]


# ---- the routes ----------------------------------------------------------------------------------


def test_openai_route_decodes_tiktoken_ids_to_text(tiktoken_own: tiktoken.Encoding) -> None:
    state = StubState(OK)
    ids = [tiktoken_own.encode(t) for t in TEXTS]
    r = client_for(state).post("/v1/embeddings", json={
        "model": "m", "input": ids, "encoding_format": "base64", "dimensions": 2})
    assert r.status_code == 200 and r.content == OK[1]
    assert state.sent[0]["payload"] == {"model": "m", "input": TEXTS,
                                        "encoding_format": "base64", "dimensions": 2}


def test_ollama_route_decodes_tiktoken_ids_to_text(tiktoken_own: tiktoken.Encoding) -> None:
    state = StubState(OK)
    r = client_for(state).post("/api/embed", json={
        "model": "m", "input": tiktoken_own.encode(TEXTS[0])})
    assert r.status_code == 200
    assert state.sent[0]["payload"]["input"] == [TEXTS[0]]


@pytest.mark.parametrize("spec", [
    LlamaCppModel(id="own", path=Path("own.gguf"), token_ids="model"),
    TransformersModel(id="own", path=Path("own"), token_ids="model"),
])
def test_a_model_set_to_its_own_ids_gets_them_unchanged(spec: Any) -> None:
    state = StubState(OK)
    state.registry.services["own"] = spec
    raw = b'{"model": "own", "input": [[1, 2, 3], [100300]]}'
    r = client_for(state).post("/v1/embeddings", content=raw)
    assert r.status_code == 200
    assert state.sent[0]["payload"]["input"] == [[1, 2, 3], [100300]]
    r = client_for(state).post("/api/embed", json={"model": "own", "input": [7, 8]})
    assert r.status_code == 200
    assert state.sent[1]["payload"]["input"] == [[7, 8]]


def test_the_setting_defaults_to_tiktoken() -> None:
    assert LlamaCppModel(id="m", path=Path("m.gguf")).token_ids == "tiktoken"


def test_an_unknown_id_is_refused_before_leasing() -> None:
    state = StubState(OK)
    for path, shape in (("/v1/embeddings", "openai"), ("/api/embed", "ollama")):
        r = client_for(state).post(path, json={"model": "m", "input": [[15339], [100277]]})
        assert r.status_code == 400
        if shape == "openai":
            error = r.json()["error"]
            assert (error["type"], error["code"], error["param"]) == (
                "invalid_request_error", "invalid_token_id", "input")
        else:
            assert "100277" in r.json()["error"]
    assert not state.sent
