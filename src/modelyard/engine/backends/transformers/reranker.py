"""Cross-encoder reranking with plain transformers: `*ForSequenceClassification` with one label.

The query and each document go through the model together as one pair (the tokenizer's pair
encoding: `[CLS] query [SEP] doc [SEP]` for BERT-likes), and the single logit is the document's
relevance. Scores are returned raw, as llama-server's `/v1/rerank` returns its own; the front
maps both through a sigmoid (sentence-transformers' CrossEncoder default for one label), so a
client sees scores in (0, 1) whichever backend scored.

Thread-safety as embedder.py: the server calls `score` from worker threads, one call at a time
under the reranker's lock; `load` reads the weights (seconds): call it from a worker thread too.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from modelyard.rerank_shapes import RerankScores

BATCH_SIZE = 32  # pairs per forward pass (sentence-transformers' CrossEncoder default)


class Reranker:
    def __init__(self, model: Any, tokenizer: Any, *, max_length: int, device: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.device = device
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: Path, *, device: str = "cpu") -> Reranker:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        dtype = torch.float32 if device == "cpu" else torch.float16
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=dtype)
        if model.config.num_labels != 1:
            raise ValueError(
                f"{path}: a reranker has one label, this classifier has {model.config.num_labels}"
            )
        model.to(device)
        model.eval()
        # What both the model and the tokenizer take (a tokenizer without a limit says 1e30).
        limits = [getattr(model.config, "max_position_embeddings", None),
                  getattr(tokenizer, "model_max_length", None)]
        max_length = min((int(x) for x in limits if isinstance(x, int) and 0 < x < 10**7),
                         default=512)
        return cls(model, tokenizer, max_length=max_length, device=device)

    def score(self, query: str, documents: list[str]) -> RerankScores:
        """The raw relevance logit of each document for `query`, in order, and the tokens the
        pairs took (each cut to the model's length, the longer of the two texts first)."""
        import torch

        scores: list[float] = []
        tokens = 0
        with self._lock, torch.inference_mode():
            for start in range(0, len(documents), BATCH_SIZE):
                docs = documents[start:start + BATCH_SIZE]
                batch = self.tokenizer(
                    [query] * len(docs), docs, padding=True, truncation=True,
                    max_length=self.max_length, return_tensors="pt",
                ).to(self.device)
                tokens += int(batch["attention_mask"].sum())
                logits = self.model(**batch).logits
                scores += logits[:, 0].float().cpu().tolist()
        return RerankScores(scores, tokens)
