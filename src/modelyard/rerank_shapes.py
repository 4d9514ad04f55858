"""Rerank requests and responses (Jina's and Cohere's shape): pure, no torch.

Shared by the front (which checks a request before any load and renders the answer) and the
transformers backend (which scores), like modelyard.embeddings_shapes.

`POST /v1/rerank` (also `/rerank`):
    {"model", "query": str, "documents": [str | {"text": str}], "top_n": int,
     "return_documents": bool (default false)}
    → {"object": "list", "model", "results": [{"index", "relevance_score", "document"?: {"text"}}],
       "usage": {"prompt_tokens", "total_tokens"}}
  results sorted by score, best first, cut to `top_n`.

Every backend is asked for the scores of all documents in llama-server's shape (the same request
with plain-string documents; an answer with `results[].index` and `relevance_score`, in any
order, plus `usage`), and the front sorts, cuts and attaches documents itself: so the answer is
the same whichever backend scored (llama-server's own `top_n` and document echo vary by version).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from modelyard.embeddings_shapes import InvalidParams

MAX_DOCUMENTS = 1000  # Cohere's limit on the documents of one request


@dataclass(frozen=True)
class RerankRequest:
    model: str
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = False


@dataclass(frozen=True)
class RerankScores:
    """One score per document, in the order of the documents, and the tokens they took."""

    scores: list[float]
    prompt_tokens: int


def _document(value: object, index: int) -> str:
    if isinstance(value, dict):
        value = value.get("text")
    if not isinstance(value, str):
        raise InvalidParams(
            f"documents[{index}] must be a string or an object with a string `text`", "documents"
        )
    return value


def parse_rerank_request(body: object, *, require_model: bool = True) -> RerankRequest:
    """A rerank body; raises InvalidParams (400, naming the field) for a bad one."""
    if not isinstance(body, dict):
        raise InvalidParams("request body must be a JSON object")
    model = body.get("model")
    if require_model and (not isinstance(model, str) or not model.strip()):
        raise InvalidParams("`model` is required (a non-empty string)", "model")
    query = body.get("query")
    if isinstance(query, dict):
        query = query.get("text")
    if not isinstance(query, str) or not query:
        raise InvalidParams("`query` is required (a non-empty string)", "query")
    docs = body.get("documents")
    if not isinstance(docs, list) or not docs:
        raise InvalidParams("`documents` is required (a non-empty list)", "documents")
    if len(docs) > MAX_DOCUMENTS:
        raise InvalidParams(
            f"`documents` has {len(docs)} items; at most {MAX_DOCUMENTS} per request", "documents"
        )
    top_n = body.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise InvalidParams(f"`top_n` must be an integer of at least 1, not {top_n!r}", "top_n")
    return_documents = body.get("return_documents", False)
    if not isinstance(return_documents, bool):
        raise InvalidParams("`return_documents` must be true or false", "return_documents")
    return RerankRequest(
        model=str(model or ""), query=query,
        documents=[_document(d, i) for i, d in enumerate(docs)],
        top_n=top_n, return_documents=return_documents,
    )


def backend_body(req: RerankRequest) -> dict[str, Any]:
    """What a backend is asked: every document's score."""
    return {"model": req.model, "query": req.query, "documents": req.documents,
            "top_n": len(req.documents), "return_documents": False}


def render_backend(model: str, scores: RerankScores) -> dict[str, Any]:
    """A backend's answer (the transformers backend's; llama-server's has this shape too)."""
    return {
        "object": "list", "model": model,
        "results": [{"index": i, "relevance_score": s} for i, s in enumerate(scores.scores)],
        "usage": {"prompt_tokens": scores.prompt_tokens, "total_tokens": scores.prompt_tokens},
    }


def read_backend(body: object, count: int) -> RerankScores:
    """The scores of `count` documents from a backend's answer; ValueError for one that is not
    (a score missing, an index out of range)."""
    if not isinstance(body, dict) or not isinstance(body.get("results"), list):
        raise ValueError("no `results` list")
    scores: list[float | None] = [None] * count
    for item in body["results"]:
        index = item.get("index") if isinstance(item, dict) else None
        score = item.get("relevance_score") if isinstance(item, dict) else None
        if not isinstance(index, int) or not 0 <= index < count:
            raise ValueError(f"result index {index!r} is not one of the {count} documents")
        if isinstance(score, bool) or not isinstance(score, (int, float)) or math.isnan(score):
            raise ValueError(f"result {index} has no numeric relevance_score")
        scores[index] = float(score)
    missing = [i for i, s in enumerate(scores) if s is None]
    if missing:
        raise ValueError(f"no score for documents {missing[:5]}")
    usage = body.get("usage")
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return RerankScores([s for s in scores if s is not None],
                        tokens if isinstance(tokens, int) else 0)


def render_rerank(req: RerankRequest, model: str, scores: RerankScores) -> dict[str, Any]:
    """The client's answer: best first (ties keep the documents' order), cut to `top_n`."""
    order = sorted(range(len(scores.scores)), key=lambda i: (-scores.scores[i], i))
    results = []
    for i in order[: req.top_n]:
        result: dict[str, Any] = {"index": i, "relevance_score": scores.scores[i]}
        if req.return_documents:
            result["document"] = {"text": req.documents[i]}
        results.append(result)
    return {
        "object": "list", "model": model, "results": results,
        "usage": {"prompt_tokens": scores.prompt_tokens, "total_tokens": scores.prompt_tokens},
    }


def sigmoid(score: float) -> float:
    """A raw cross-encoder logit as a relevance in (0, 1), without overflow for large ones."""
    if score >= 0:
        return 1.0 / (1.0 + math.exp(-score))
    e = math.exp(score)
    return e / (1.0 + e)


def rerank_handler(
    score: Callable[[str, list[str]], RerankScores], model_name: str
) -> Callable[[Any], dict[str, Any]]:
    """The `rerank` callable `server.build_app` takes: request body in, response body out
    (raw scores of every document, rerank_shapes' backend shape). `score` is
    `Reranker.score`."""

    def handle(body: Any) -> dict[str, Any]:
        req = parse_rerank_request(body, require_model=False)
        return render_backend(req.model or model_name, score(req.query, req.documents))

    return handle
