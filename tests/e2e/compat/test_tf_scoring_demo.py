"""Prompt scoring on the transformers engine (engine/backends/transformers/scoring.py): the
official `openai` SDK against the engine's own HTTP app serving the demo model as safetensors,
in this process (the front passes such a request on unchanged, as to vLLM). `echo` with an
integer `logprobs` gives the prompt's tokens their log probabilities from one forward pass."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from tests.support import demo_batch_generator

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def loaded() -> Iterator[Any]:
    with demo_batch_generator() as (_, tokenizer, gen):
        yield tokenizer, gen


@pytest.fixture
async def oai(loaded: Any) -> AsyncIterator[openai.AsyncOpenAI]:
    from modelyard.engine.backends.transformers.loader import (
        chat_prompt_ids,
        completion_prompt_ids,
    )
    from modelyard.engine.backends.transformers.server import build_app

    tokenizer, gen = loaded
    app = build_app("smol", gen, lambda body: chat_prompt_ids(tokenizer, body),
                    lambda body: completion_prompt_ids(tokenizer, body))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://engine") as http:
        yield openai.AsyncOpenAI(base_url="http://engine/v1", api_key="unused",
                                 http_client=http, max_retries=0)


async def test_echo_with_logprobs_scores_every_prompt_token(oai: openai.AsyncOpenAI,
                                                            loaded: Any) -> None:
    answer = await oai.completions.create(model="smol", prompt=PROMPT, echo=True, logprobs=1,
                                          max_tokens=0)
    choice = answer.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert "".join(lp.tokens) == PROMPT
    assert len(lp.tokens) == len(loaded[0](PROMPT)["input_ids"])
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for logprob, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert isinstance(logprob, float) and logprob <= 0
        assert isinstance(top, dict) and len(top) == 1 and logprob <= max(top.values()) + 1e-5
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]


async def test_a_scored_token_has_the_logprob_a_completion_gives_it(
        oai: openai.AsyncOpenAI, loaded: Any) -> None:  # fmt: skip
    plain = await oai.completions.create(model="smol", prompt=PROMPT, max_tokens=1, logprobs=1,
                                         temperature=0)
    content = plain.choices[0].logprobs
    # the engine answers the chat shape; the front turns it into the completions one
    entry = content.model_extra["content"][0] if content is not None else None  # type: ignore[index]
    assert entry is not None
    scored = await oai.completions.create(model="smol", prompt=PROMPT + entry["token"],
                                          echo=True, logprobs=2, max_tokens=0)
    lp = scored.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.tokens[-1] == entry["token"]
    assert math.isclose(lp.token_logprobs[-1], entry["logprob"], abs_tol=1e-3)
    # and with a generated token after the prompt (lm-eval's max_tokens 1), from token ids
    ids = loaded[0](PROMPT + entry["token"])["input_ids"]
    both = await oai.completions.create(model="smol", prompt=[ids],
                                        echo=True, logprobs=1, max_tokens=1, temperature=0)
    blp = both.choices[0].logprobs
    assert blp is not None and blp.tokens is not None and blp.token_logprobs is not None
    assert blp.tokens[:-1] == lp.tokens and len(blp.tokens) == len(ids) + 1
    assert math.isclose(blp.token_logprobs[-2], entry["logprob"], abs_tol=1e-3)

