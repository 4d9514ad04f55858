"""The transformers backend's cross-encoder: a tiny random BertForSequenceClassification (one
label) saved with conftest's tokenizer, scored directly and through an engine's /v1/rerank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.e2e.compat.table import covers

from modelyard.config import Settings, TransformersModel
from modelyard.engine.backends.transformers.reranker import Reranker
from modelyard.engine.loop import Engine
from modelyard.store.kinds import repo_kind
from modelyard.store.registry import ModelRegistry

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

QUERY = "the quick brown fox"
DOCS = ["The quick brown fox jumps over the lazy dog.", "def main():\n    return 42\n",
        "Hello world! Hello there, general Kenobi.", "A prefix cache keeps the KV."]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64, num_labels=1,
                        max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("tiny-cross-encoder")
    BertForSequenceClassification(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def direct_scores(repo: Path, query: str, docs: list[str]) -> list[float]:
    """Each pair through the model alone (no batching, no padding)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(repo).eval()
    tok = AutoTokenizer.from_pretrained(repo)
    with torch.inference_mode():
        return [float(model(**tok(query, d, return_tensors="pt")).logits[0, 0]) for d in docs]


def test_the_repo_is_a_reranker_and_scores_each_pair_as_alone(repo: Path) -> None:
    assert repo_kind(repo) == "rerank"
    reranker = Reranker.load(repo)
    got = reranker.score(QUERY, DOCS)
    assert got.scores == pytest.approx(direct_scores(repo, QUERY, DOCS), abs=1e-4)
    assert got.prompt_tokens > 0
    assert len(set(got.scores)) == len(DOCS)  # a random head still tells the documents apart


@covers("Rerank (`/v1/rerank`, `/rerank`)", "OpenAI")
async def test_an_engine_serves_the_cross_encoder_at_v1_rerank(repo: Path, tmp_path: Path) -> None:
    spec = TransformersModel(id="ce", path=repo)
    settings = Settings(home=tmp_path, scan_hf_cache=False, embedding_demo=False,
                        devices="cpu", models=[spec])
    engine = Engine(settings, ModelRegistry.build(settings))
    try:
        lease = await engine.acquire("ce")
        async with httpx.AsyncClient(base_url=lease.upstream, timeout=60, headers={
                "Authorization": f"Bearer {lease.api_key}"}) as client:  # as the front sends
            r = await client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["model"] == "ce"
            scores = {x["index"]: x["relevance_score"] for x in body["results"]}
            expected = direct_scores(repo, QUERY, DOCS)
            assert [scores[i] for i in range(len(DOCS))] == pytest.approx(expected, abs=1e-4)
            bad = await client.post("/v1/rerank", json={"query": QUERY, "documents": []})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"
            chat = await client.post("/v1/chat/completions", json={"messages": []})
            assert chat.status_code == 400 and "/v1/rerank" in chat.json()["error"]["message"]
        engine.release(lease.id)
    finally:
        await engine.shutdown()
