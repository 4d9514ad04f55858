"""Issue 32, item 9: the transformers engine names the stop string that ended an answer, as
vLLM does (the choice's `stop_reason`), so the Anthropic API can report `stop_sequence`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from modelyard.engine.backends.transformers.detok import StopMatcher
from modelyard.engine.backends.transformers.generator import BatchGenerator, TokenEvent
from modelyard.engine.backends.transformers.params import SamplingParams
from modelyard.engine.backends.transformers.server import Completion

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def test_the_matcher_names_the_earliest_stop_string() -> None:
    stops = StopMatcher(["world", "lo w", "never"])
    assert stops.feed("Hel") == "He" and stops.matched is None  # "l" may begin "lo w"
    assert stops.feed("lo world") == "l" and stops.matched == "lo w"  # before "world"
    assert StopMatcher(["x"]).matched is None


async def scripted(stop: str | None) -> AsyncIterator[TokenEvent]:
    yield TokenEvent(text="1, 2, ", token_ids=[1], logprobs=None, finish_reason=None)
    yield TokenEvent(text="", token_ids=[2], logprobs=None, finish_reason="stop",
                     usage={"prompt_tokens": 3, "completion_tokens": 2}, timings={},
                     stop_sequence=stop)


def body(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "count"}], **extra}


async def streamed(stop: str | None) -> list[bytes]:
    return [c async for c in Completion("m", True, body(stream=True)).stream([scripted(stop)])]


def test_the_answer_carries_it_as_stop_reason_whole_and_streamed() -> None:
    out = asyncio.run(Completion("m", True, body()).whole([scripted("3")]))
    assert out["choices"][0]["stop_reason"] == "3"
    assert out["choices"][0]["finish_reason"] == "stop"
    assert b'"stop_reason":"3"' in b"".join(asyncio.run(streamed("3")))
    # The end of the turn names nothing.
    assert "stop_reason" not in asyncio.run(Completion("m", True, body()).whole(
        [scripted(None)]))["choices"][0]
    assert b"stop_reason" not in b"".join(asyncio.run(streamed(None)))


@pytest.fixture
async def gen(model: Any, tokenizer: Any) -> AsyncIterator[BatchGenerator]:
    g = BatchGenerator(model, tokenizer, max_batch_size=2, prefill_chunk_tokens=16)
    g.start()
    yield g
    g.stop()


async def test_the_generator_reports_the_stop_string_it_hit(
        gen: BatchGenerator, tokenizer: Any) -> None:
    prompt = tokenizer.encode("The quick brown fox")
    text = "".join([e.text async for e in gen.generate(prompt, SamplingParams(
        temperature=0, max_tokens=30))])
    stop = text[4:7]
    events = [e async for e in gen.generate(prompt, SamplingParams(
        temperature=0, max_tokens=30, stop=("never-seen", stop)))]
    assert events[-1].finish_reason == "stop" and events[-1].stop_sequence == stop
    ended = [e async for e in gen.generate(prompt, SamplingParams(temperature=0, max_tokens=5,
                                                                  stop=("never-seen",)))]
    assert ended[-1].finish_reason == "length" and ended[-1].stop_sequence is None
