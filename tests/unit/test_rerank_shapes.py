"""Rerank request parsing, the backend answer's reading, and the client's answer (pure)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from modelyard.embeddings_shapes import InvalidParams
from modelyard.rerank_shapes import (
    MAX_DOCUMENTS,
    RerankScores,
    backend_body,
    parse_rerank_request,
    read_backend,
    render_rerank,
    sigmoid,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def test_documents_as_strings_or_text_objects() -> None:
    req = parse_rerank_request({"model": "r", "query": "q", "documents": ["a", {"text": "b"}],
                                "top_n": 1, "return_documents": True})
    assert (req.documents, req.top_n, req.return_documents) == (["a", "b"], 1, True)
    assert backend_body(req)["documents"] == ["a", "b"]  # every score asked, strings only
    assert backend_body(req)["top_n"] == 2


@pytest.mark.parametrize(("body", "param"), [
    ({"query": "q", "documents": ["a"]}, "model"),
    ({"model": "r", "query": "", "documents": ["a"]}, "query"),
    ({"model": "r", "query": "q", "documents": "a"}, "documents"),
    ({"model": "r", "query": "q", "documents": [{"title": "a"}]}, "documents"),
    ({"model": "r", "query": "q", "documents": ["a"] * (MAX_DOCUMENTS + 1)}, "documents"),
    ({"model": "r", "query": "q", "documents": ["a"], "top_n": True}, "top_n"),
    ({"model": "r", "query": "q", "documents": ["a"], "return_documents": "yes"},
     "return_documents"),
])
def test_bad_requests_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParams) as caught:
        parse_rerank_request(body)
    assert caught.value.param == param


def test_backend_answers_in_any_order_are_read_by_index() -> None:
    body = {"results": [{"index": 1, "relevance_score": -2}, {"index": 0, "relevance_score": 3.5}],
            "usage": {"prompt_tokens": 9}}
    assert read_backend(body, 2) == RerankScores([3.5, -2.0], 9)
    for broken in ({"results": [{"index": 0, "relevance_score": 1}]},  # a score missing
                   {"results": [{"index": 2, "relevance_score": 1}]},  # out of range
                   {"results": [{"index": 0, "relevance_score": "high"}]},
                   {"data": []}):
        with pytest.raises(ValueError):
            read_backend(broken, 2)


def test_the_answer_is_best_first_cut_and_stable_on_ties() -> None:
    req = parse_rerank_request({"model": "r", "query": "q", "documents": ["a", "b", "c", "d"],
                                "top_n": 3, "return_documents": True})
    out = render_rerank(req, "r", RerankScores([0.1, 0.7, 0.1, 0.9], 4))
    assert [(x["index"], x["document"]["text"]) for x in out["results"]] == [
        (3, "d"), (1, "b"), (0, "a")]
    assert out["usage"] == {"prompt_tokens": 4, "total_tokens": 4}


def test_sigmoid_is_monotonic_and_safe_for_large_logits() -> None:
    assert sigmoid(0) == 0.5 and sigmoid(-1000) == 0.0 and sigmoid(1000) == 1.0
    assert sigmoid(2) == pytest.approx(1 / (1 + math.exp(-2)))
