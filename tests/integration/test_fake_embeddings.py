"""The fake llama-server's embeddings (`--embeddings`, as llama-server's flag), relayed through a
real `modelyard serve` to `openai` models: what `make bench-front` measures its embedding
workload on. Without the flag the fake answers llama-server's 501, which the front passes on."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterator

import httpx
import pytest
from tests.integration.harness import config, module_server
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

DIM = 8  # the fake's EMBEDDING_DIM


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # token_ids "model": the front relays token ids as sent (it decodes tiktoken's to text)
    cfg = config(fake_model("embedder", "--embeddings", token_ids="model"), fake_model("plain"))
    with module_server(tmp_path_factory, cfg, "--single-process") as srv:
        yield srv


def embed(server: Server, model: str, **body: object) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json={"model": model, **body}, timeout=30)


def test_embeddings_answer_one_unit_vector_per_input_in_openai_shape(server: Server) -> None:
    r = embed(server, "embedder", input=["the cat sat", "the cat sat", "dog"])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "embedder"
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", i)
                                                                for i in range(3)]
    vectors = [d["embedding"] for d in body["data"]]
    assert all(len(v) == DIM for v in vectors)
    assert all(math.isclose(math.hypot(*v), 1.0) for v in vectors)
    assert vectors[0] == vectors[1] != vectors[2]  # deterministic, and tells inputs apart
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}


def test_a_string_and_token_ids_are_inputs_too(server: Server) -> None:
    one = embed(server, "embedder", input="hello there")
    assert one.status_code == 200 and len(one.json()["data"]) == 1
    ids = embed(server, "embedder", input=[[5, 6, 7], [8]])
    assert ids.status_code == 200, ids.text
    assert len(ids.json()["data"]) == 2 and ids.json()["usage"]["prompt_tokens"] == 4


def test_base64_is_the_same_vector_as_little_endian_float32(server: Server) -> None:
    floats = embed(server, "embedder", input="a b c").json()["data"][0]["embedding"]
    packed = embed(server, "embedder", input="a b c", encoding_format="base64")
    assert packed.status_code == 200, packed.text
    raw = base64.b64decode(packed.json()["data"][0]["embedding"])
    assert struct.unpack(f"<{DIM}f", raw) == pytest.approx(floats, rel=1e-6)


def test_without_the_flag_it_is_llama_servers_501_passed_on(server: Server) -> None:
    r = embed(server, "plain", input="hi")
    assert r.status_code == 501, r.text
    assert r.json()["error"]["type"] == "not_supported_error"
    assert "--embeddings" in r.json()["error"]["message"]
