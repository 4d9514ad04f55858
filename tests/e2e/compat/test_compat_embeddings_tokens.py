"""LangChain's OpenAIEmbeddings with its defaults against `all-minilm` (issue 32, item 1).

By default it counts tokens with tiktoken (cl100k_base: `all-minilm` is no OpenAI model name)
and sends each text's token ids as `input`; modelyard decodes them back to text, so the vectors
are the plain text's. The client's tiktoken reads the encoding modelyard ships, put where
tiktoken's cache looks for it: nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from langchain_openai import OpenAIEmbeddings
from tests.e2e.compat.table import covers
from tests.support import Server

from modelyard.front.api.token_ids import ENCODING_FILE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

# tiktoken's cache names the file by the sha1 of the URL it would download it from.
BLOB = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
TEXTS = [
    "A cat sits on the mat.",
    "Ünïcödé café, an emoji 🙂 and\ntwo lines.",
    "Retrieval-augmented generation splits documents into chunks before embedding them. " * 8,
]


@pytest.fixture(scope="module")
def tiktoken_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    cache = tmp_path_factory.mktemp("tiktoken-cache")
    shutil.copy(ENCODING_FILE, cache / hashlib.sha1(BLOB.encode()).hexdigest())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        yield cache


@pytest.fixture(scope="module")
def oai(compat_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=compat_server.url + "/v1", api_key="unused", timeout=240,
                         max_retries=0)


@covers("Embeddings of token ids (LangChain `OpenAIEmbeddings` defaults)", "OpenAI")
def test_langchain_openai_embeddings_defaults_get_the_texts_vectors(
    compat_server: Server, tiktoken_cache: Path, oai: openai.OpenAI
) -> None:
    client = OpenAIEmbeddings(base_url=compat_server.url + "/v1", api_key="unused",
                              model="all-minilm", max_retries=0)
    assert client.check_embedding_ctx_length and client.tiktoken_enabled  # the defaults
    got = client.embed_documents(TEXTS)
    query = client.embed_query(TEXTS[0])

    plain = oai.embeddings.create(model="all-minilm", input=TEXTS)
    want = [d.embedding for d in plain.data]
    assert [len(v) for v in got] == [384] * len(TEXTS)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(query, want[0], rtol=1e-4, atol=1e-5)


def test_token_ids_count_the_models_tokens_of_their_text(oai: openai.OpenAI) -> None:
    # LangChain's ids for TEXTS[0] (cl100k_base), sent as they are: usage counts the model's
    # tokens of the decoded text, as for the text itself.
    ids = [32, 8415, 23874, 389, 279, 5634, 13]
    from_ids = oai.embeddings.create(model="all-minilm", input=[ids], encoding_format="float")
    from_text = oai.embeddings.create(model="all-minilm", input=[TEXTS[0]],
                                      encoding_format="float")
    np.testing.assert_allclose(from_ids.data[0].embedding, from_text.data[0].embedding,
                               rtol=1e-4, atol=1e-5)
    assert from_ids.usage.prompt_tokens == from_text.usage.prompt_tokens > 0


def test_an_id_outside_cl100k_base_is_a_400_on_input(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.embeddings.create(model="all-minilm", input=[[32, 8415], [32, 100277]])
    assert caught.value.code == "invalid_token_id" and caught.value.param == "input"
    assert "100277" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        oai.embeddings.create(model="all-minilm", input=[[32], []])
    assert caught.value.param == "input" and "empty" in caught.value.message
