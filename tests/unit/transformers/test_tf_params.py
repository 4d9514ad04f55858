"""SamplingParams: OpenAI bodies in; validated parameters, or InvalidParams naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from modelyard.engine.backends.transformers.params import InvalidParams, SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def test_defaults_are_openais() -> None:
    p = SamplingParams.from_openai({})
    assert p == SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.logprobs) == \
        (1.0, 1.0, 0, 0.0, None, None)
    assert not p.greedy and not p.penalized


def test_a_full_chat_body() -> None:
    p = SamplingParams.from_openai({
        "temperature": 0, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7,
        "stop": ["\n\n", "END"], "max_completion_tokens": 64, "max_tokens": 10,
        "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "logprobs": True, "top_logprobs": 3, "n": 1, "stream": True, "messages": [],
    })
    assert p == SamplingParams(max_tokens=64, temperature=0.0, top_p=0.9, top_k=40, min_p=0.05,
                               seed=7, stop=("\n\n", "END"), repetition_penalty=1.1,
                               presence_penalty=0.5, frequency_penalty=-0.5, logprobs=3)
    assert p.greedy and p.penalized


@pytest.mark.parametrize(("body", "expected"), [
    ({"stop": "###"}, {"stop": ("###",)}),
    ({"stop": None, "seed": None, "temperature": None}, {}),
    ({"max_tokens": 5}, {"max_tokens": 5}),
    ({"max_tokens": 5.0}, {"max_tokens": 5}),
    ({"logprobs": True}, {"logprobs": 0}),
    ({"logprobs": False}, {}),
    ({"logprobs": 2}, {"logprobs": 2}),  # legacy completions
    ({"logprobs": 0}, {"logprobs": 0}),
    ({"seed": -1}, {"seed": 2**64 - 1}),
    ({"temperature": 1}, {"temperature": 1.0}),
    ({"top_k": 1}, {"top_k": 1}),
    ({"ignore_eos": True}, {"ignore_eos": True}),
])
def test_accepted(body: dict[str, Any], expected: dict[str, Any]) -> None:
    assert SamplingParams.from_openai(body) == SamplingParams(**expected)


@pytest.mark.parametrize(("body", "param"), [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"stop": 3}, "stop"),
    ({"stop": ["a", 1]}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_completion_tokens": -5}, "max_tokens"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"seed": "x"}, "seed"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_rejected(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParams) as info:
        SamplingParams.from_openai(body)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)
    assert str(info.value)


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(InvalidParams) as info:
        SamplingParams(top_p=0.0)
    assert info.value.param == "top_p"
