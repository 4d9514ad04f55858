"""End to end: prompt scoring on /v1/completions (front/chat/scoring.py) with the official
`openai` SDK against the demo model on llama-server, as lm-evaluation-harness's
`local-completions` asks it for log-likelihood tasks: `echo` with an integer `logprobs` gives the
prompt's tokens their log probabilities (the first `null`), `max_tokens: 0` generates nothing.
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from tests.e2e.compat.table import covers
from tests.support import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PROMPT = "The capital of France is"
# PROMPT as the demo model's ids (SmolLM2's tokenizer adds no BOS): lm-eval sends ids.
PROMPT_IDS = [504, 3575, 282, 4649, 314]


@pytest.fixture(scope="module")
def oai(compat_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=compat_server.url + "/v1", api_key="unused", timeout=180,
                         max_retries=0)


@covers("Log probabilities", "OpenAI")
@covers("Text completion", "OpenAI")
def test_echo_with_logprobs_scores_every_prompt_token(oai: openai.OpenAI) -> None:
    answer = oai.completions.create(model="smollm2", prompt=PROMPT, echo=True, logprobs=1,
                                    max_tokens=0, temperature=0)
    choice = answer.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert "".join(lp.tokens) == PROMPT and len(lp.tokens) == len(PROMPT_IDS)
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(lp.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for logprob, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert isinstance(logprob, float) and logprob <= 0
        assert isinstance(top, dict) and len(top) == 1
        # lm-eval's is_greedy reads the best alternative; the token's own can be no better
        assert logprob <= max(top.values()) + 1e-6
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert lp.text_offset == sorted(set(lp.text_offset))
    assert answer.usage is not None and answer.usage.prompt_tokens == len(PROMPT_IDS)
    assert answer.usage.completion_tokens == 0


def test_a_scored_token_has_the_logprob_a_completion_gives_it(oai: openai.OpenAI) -> None:
    """The value, checked independently: the greedy next token of PROMPT, as a normal
    completion reports it, scored as the prompt's last token."""
    plain = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1, logprobs=1,
                                   temperature=0, seed=7)
    lp = plain.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs
    greedy, expected = lp.tokens[0], lp.token_logprobs[0]
    assert greedy == " Paris"  # one token: PROMPT + it tokenizes as PROMPT's ids + its id
    scored = oai.completions.create(model="smollm2", prompt=PROMPT + greedy, echo=True,
                                    logprobs=2, max_tokens=0)
    slp = scored.choices[0].logprobs
    assert slp is not None and slp.tokens and slp.token_logprobs and slp.top_logprobs
    assert slp.tokens[-1] == greedy
    assert math.isclose(slp.token_logprobs[-1], expected, abs_tol=1e-3)
    assert max(slp.top_logprobs[-1], key=slp.top_logprobs[-1].__getitem__) == greedy


def test_lm_eval_shape_token_ids_and_one_generated_token(oai: openai.OpenAI) -> None:
    """What `local-completions` sends: a batch of token-id prompts, echo, logprobs 1,
    max_tokens 1, temperature 0; it reads token_logprobs[ctxlen:-1]."""
    answer = oai.completions.create(model="smollm2", prompt=[PROMPT_IDS], echo=True,
                                    logprobs=1, max_tokens=1, temperature=0, seed=1234)
    by_text = oai.completions.create(model="smollm2", prompt=PROMPT, echo=True, logprobs=1,
                                     max_tokens=0)
    lp, text_lp = answer.choices[0].logprobs, by_text.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs
    assert text_lp is not None and text_lp.tokens and text_lp.token_logprobs
    assert len(lp.tokens) == len(PROMPT_IDS) + 1  # the prompt's, then the one generated
    assert lp.tokens[:-1] == text_lp.tokens
    for by_ids, by_str in zip(lp.token_logprobs[1:-1], text_lp.token_logprobs[1:], strict=True):
        assert by_ids is not None and by_str is not None
        assert math.isclose(by_ids, by_str, abs_tol=1e-4)
    assert answer.choices[0].text == PROMPT + lp.tokens[-1]
    assert answer.usage is not None and answer.usage.completion_tokens == 1


def test_max_tokens_zero_generates_nothing(oai: openai.OpenAI) -> None:
    answer = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=0)
    assert answer.choices[0].text == "" and answer.choices[0].finish_reason == "length"
    echoed = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=0, echo=True)
    assert echoed.choices[0].text == PROMPT


def test_scoring_a_prompt_over_the_bound_is_a_400(compat_server: Server) -> None:
    long_prompt = "one two three four " * 300  # > max_scored_prompt_tokens (1024)
    r = httpx.post(compat_server.url + "/v1/completions", timeout=120, json={
        "model": "smollm2", "prompt": long_prompt, "echo": True, "logprobs": 1,
        "max_tokens": 0})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "prompt_too_long_for_scoring"
