"""Several choices (`n`) on the transformers server: the real `Completion` (server.py) over
scripted token streams, one per choice, whole and streamed; `n`'s bounds and each choice's seed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from modelyard.engine.backends.transformers.generator import TokenEvent
from modelyard.engine.backends.transformers.params import (
    MAX_CHOICES,
    InvalidParams,
    SamplingParams,
    choices_of,
)
from modelyard.engine.backends.transformers.server import Completion, _choice_params

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


async def scripted(pieces: list[str], cached: int = 0) -> AsyncIterator[TokenEvent]:
    for n, text in enumerate(pieces):
        last = n == len(pieces) - 1
        await asyncio.sleep(0)  # let the other choice interleave
        yield TokenEvent(text=text, token_ids=[n], logprobs=None,
                         finish_reason="stop" if last else None,
                         usage={"prompt_tokens": 5, "completion_tokens": len(pieces),
                                "cached_tokens": cached} if last else None,
                         timings={"decode_ms": 10.0} if last else None)


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **extra}


def test_whole_has_each_choice_by_index_and_the_whole_usage() -> None:
    out = asyncio.run(Completion("m", True, chat(n=2)).whole(
        [scripted(["a", "b"]), scripted(["c", "d", "e"], cached=5)]))
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in out["choices"]] == ["ab", "cde"]
    # the prompt once (its reuse: the least cached), the completions added up
    assert out["usage"]["prompt_tokens"] == 5
    assert out["usage"]["completion_tokens"] == 5
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert out["timings"]["predicted_n"] == 5


def test_text_completions_too() -> None:
    out = asyncio.run(Completion("m", False, {"prompt": "x"}).whole(
        [scripted(["a"]), scripted(["b"])]))
    assert [(c["index"], c["text"]) for c in out["choices"]] == [(0, "a"), (1, "b")]


def test_stream_interleaves_the_choices_and_sends_one_usage() -> None:
    async def collect() -> list[Any]:
        completion = Completion("m", True, chat(n=2, stream=True,
                                                stream_options={"include_usage": True}))
        lines = []
        async for raw in completion.stream([scripted(["a", "b"]), scripted(["c", "d", "e"])]):
            lines += [line for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]

    events = asyncio.run(collect())
    texts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["delta"].get("content", "")
    assert texts == {0: "ab", 1: "cde"}
    finishes = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert sorted(finishes) == [0, 1]
    usages = [e["usage"] for e in events if "usage" in e]
    assert len(usages) == 1 and events[-1]["choices"] == []
    assert usages[0]["completion_tokens"] == 5 and usages[0]["prompt_tokens"] == 5


def test_n_is_bounded() -> None:
    assert choices_of({}) == 1
    assert choices_of({"n": 3}) == 3
    for bad in (0, MAX_CHOICES + 1, "2"):
        with pytest.raises(InvalidParams) as info:
            choices_of({"n": bad})
        assert info.value.param == "n"


def test_each_choice_has_its_own_seed() -> None:
    params = SamplingParams.from_openai({"seed": 7, "temperature": 1.0})
    assert [_choice_params(params, i).seed for i in range(3)] == [7, 8, 9]
    unseeded = SamplingParams.from_openai({})
    assert _choice_params(unseeded, 2).seed is None


# ---- the real generator: the tiny random model, n rows of one batch ----------------------------


@pytest.fixture
async def served(model: Any, tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    from modelyard.engine.backends.transformers.constraints import Compiler
    from modelyard.engine.backends.transformers.generator import BatchGenerator
    from modelyard.engine.backends.transformers.server import build_app

    gen = BatchGenerator(model, tokenizer, max_batch_size=8)
    gen.start()
    def ids(body: dict[str, Any]) -> list[int]:
        return [int(i) for m in body["messages"] for i in tokenizer.encode(m["content"])]

    app = build_app("tiny", gen, ids, lambda body: [int(i) for i in tokenizer.encode(
        body["prompt"])], constrain=Compiler(tokenizer, [tokenizer.eos_token_id]).for_request)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://tiny") as client:
            yield client
    finally:
        gen.stop()


SAMPLED = {"messages": [{"role": "user", "content": "Hello world!"}], "max_tokens": 6,
           "temperature": 1.0, "seed": 3, "ignore_eos": True}


@pytest.mark.timeout(120)
async def test_n_choices_from_the_real_generator(served: httpx.AsyncClient) -> None:
    r = await served.post("/v1/chat/completions", json={**SAMPLED, "n": 3})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["completion_tokens"] == 18
    again = (await served.post("/v1/chat/completions", json={**SAMPLED, "n": 3})).json()
    texts = [c["message"]["content"] for c in out["choices"]]
    assert texts == [c["message"]["content"] for c in again["choices"]]  # seeded: reproducible
    assert len(set(texts)) > 1  # each choice its own seed

    r = await served.post("/v1/chat/completions", json={
        **SAMPLED, "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert {c["index"] for e in events for c in e["choices"]} == {0, 1}
    assert [e["usage"]["completion_tokens"] for e in events if "usage" in e] == [12]


@pytest.mark.timeout(120)
async def test_each_choice_follows_its_own_grammar(served: httpx.AsyncClient) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    r = await served.post("/v1/chat/completions", json={
        **SAMPLED, "max_tokens": 40, "ignore_eos": False, "n": 2, "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert isinstance(json.loads(choice["message"]["content"])["ok"], bool)
