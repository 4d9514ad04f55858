"""Prompt scoring's pure parts: OpenAI's completions `logprobs` for a scored prompt
(modelyard.completion_logprobs) and which /v1/completions bodies the front serves itself
(front/chat/scoring.py)."""

from __future__ import annotations

import pytest

from modelyard.completion_logprobs import added_bos, completions_logprobs
from modelyard.errors import InvalidRequest
from modelyard.front.chat import scoring

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def entry(token: str, logprob: float, *alts: tuple[str, float]) -> dict[str, object]:
    return {"token": token, "logprob": logprob,
            "top_logprobs": [{"token": t, "logprob": v} for t, v in alts]}


def test_prompt_then_generated_with_offsets_and_k_alternatives() -> None:
    out = completions_logprobs(
        [b"The", b" sky"], [None, entry(" sky", -2.0, (" sun", -1.0), (" sky", -2.0))],
        [entry(" is", -0.5, (" is", -0.5), (" was", -1.5))], k=1)
    assert out == {"tokens": ["The", " sky", " is"], "token_logprobs": [None, -2.0, -0.5],
                   "top_logprobs": [None, {" sun": -1.0}, {" is": -0.5}],
                   "text_offset": [0, 3, 7]}


def test_a_token_that_ends_inside_a_character_is_spelled_in_bytes() -> None:
    # "é" is two bytes split over two tokens: the second starts where the character does
    pieces = [b"a", b"\xc3", b"\xa9", b"b"]
    out = completions_logprobs(pieces, [None, *[entry("", -1.0)] * 3], [], k=0)
    assert out["tokens"] == ["a", "bytes:\\xc3", "bytes:\\xa9", "b"]
    assert out["text_offset"] == [0, 1, 1, 2]
    assert out["top_logprobs"][1] == {}


def test_a_bos_before_a_text_prompt_is_not_its_text() -> None:
    assert added_bos("Hi there", [b"<s>", b"Hi", b" there"])
    assert not added_bos("Hi there", [b"Hi", b" there"])
    assert not added_bos("Hi", [b"Hi"])


def test_which_bodies_the_front_serves() -> None:
    assert scoring.concerns({"prompt": "x", "max_tokens": 0})
    assert scoring.concerns({"prompt": "x", "echo": True, "logprobs": 0})
    assert not scoring.concerns({"prompt": "x", "echo": True, "max_tokens": 5})
    assert not scoring.concerns({"prompt": "x", "echo": True, "logprobs": True})
    assert not scoring.concerns({"prompt": "x", "logprobs": 2, "max_tokens": 5})
    with pytest.raises(InvalidRequest):
        scoring.concerns({"prompt": "x", "echo": True, "logprobs": 21})
