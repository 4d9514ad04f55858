"""Rerank (`/v1/rerank`, `/rerank`) and the model-kind checks of embeddings and rerank, through a
real `modelyard serve` with GGUF models served by the fake llama-server (its `--reranking` mode
mimics llama-server's /v1/rerank: raw scores, unsorted, llama-server's shape)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from gguf import GGUFWriter
from tests.e2e.compat.table import covers
from tests.integration.harness import config, module_server
from tests.support import FAKE_BACKEND, Server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

DOCS = ["a cat on a mat", "stock prices fell", "the cat and the dog", "cats sleep"]


def gguf(path: Path, arch: str, pooling: int | None = None) -> Path:
    writer = GGUFWriter(path, arch)
    if pooling is not None:
        writer.add_uint32(f"{arch}.pooling_type", pooling)
    writer.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def fake_gguf(model_id: str, path: Path, *flags: str) -> dict[str, Any]:
    """A GGUF model (its kind read from `path`) whose llama-server is the fake."""
    argv = [sys.executable, str(FAKE_BACKEND), "--host", "$host", "--port", "$port",
            "--alias", "$id", *flags]
    return {"id": model_id, "backend": "llamacpp", "path": str(path), "argv": argv}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    files = tmp_path_factory.mktemp("ggufs")
    cfg = config(
        fake_gguf("bge-reranker", gguf(files / "rerank.gguf", "bert", pooling=4), "--reranking"),
        fake_gguf("nomic-like", gguf(files / "embed.gguf", "nomic-bert")),
        fake_gguf("chatty", gguf(files / "chat.gguf", "llama")),
    )
    with module_server(tmp_path_factory, cfg) as srv:
        yield srv


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


@covers("Rerank (`/v1/rerank`, `/rerank`)", "OpenAI")
def test_rerank_sorts_cuts_and_echoes(server: Server) -> None:
    r = post(server, "/v1/rerank", {"model": "bge-reranker", "query": "the cat",
                                    "documents": [*DOCS[:3], {"text": DOCS[3]}], "top_n": 3,
                                    "return_documents": True})
    assert r.status_code == 200, r.text
    body = r.json()
    # The fake scores shared words minus one: doc 2 (2 words), doc 0 (1), then 1 and 3 (0)
    # tie: the earlier document first. Raw scores through a sigmoid: in (0, 1), same order.
    assert [x["index"] for x in body["results"]] == [2, 0, 1]
    scores = [x["relevance_score"] for x in body["results"]]
    assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
    assert scores[0] == pytest.approx(1 / (1 + np.exp(-1.0)))
    assert [x["document"]["text"] for x in body["results"]] == [DOCS[2], DOCS[0], DOCS[1]]
    assert body["model"] == "bge-reranker" and body["usage"]["prompt_tokens"] > 0


def test_rerank_alias_route_and_defaults(server: Server) -> None:
    r = post(server, "/rerank", {"model": "bge-reranker", "query": "cat", "documents": DOCS})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == len(DOCS) and all("document" not in x for x in results)


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "bge-reranker", "documents": DOCS}, "query"),
    ({"model": "bge-reranker", "query": "q", "documents": []}, "documents"),
    ({"model": "bge-reranker", "query": "q", "documents": [3]}, "documents"),
    ({"model": "bge-reranker", "query": "q", "documents": DOCS, "top_n": 0}, "top_n"),
])
def test_a_bad_rerank_request_is_a_400_naming_the_field(
    server: Server, body: dict[str, Any], param: str
) -> None:
    r = post(server, "/v1/rerank", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_chat_model_asked_to_rerank_is_a_400_naming_a_reranker(server: Server) -> None:
    r = post(server, "/v1/rerank", {"model": "chatty", "query": "q", "documents": DOCS})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "model_not_reranker" and "bge-reranker" in error["message"]


def test_embeddings_of_a_chat_model_is_a_400_the_sdk_does_not_retry(server: Server) -> None:
    """Before, llama-server's 501 came through and the OpenAI SDK retried it."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=2)
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="chatty", input="hello")
    assert caught.value.code == "model_not_embedding"
    assert "nomic-like" in caught.value.message
    r = post(server, "/api/embed", {"model": "chatty", "input": "hello"})
    assert r.status_code == 400 and "nomic-like" in r.json()["error"]


def test_an_unknown_embedding_model_is_a_404_that_suggests_one(server: Server) -> None:
    r = post(server, "/v1/embeddings", {"model": "nomic-embed-text", "input": "hi"})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and "nomic-like" in error["message"]
    r = post(server, "/api/embeddings", {"model": "nomic-embed-text", "prompt": "hi"})
    assert r.status_code == 404 and "nomic-like" in r.json()["error"]
