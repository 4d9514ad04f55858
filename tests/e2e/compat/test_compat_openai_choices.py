"""The official `openai` SDK, unchanged, with what older clients, DSPy and evaluation tools send
(issue 32): several choices (`n`, chat and text completions, whole and streamed), the legacy
`functions` / `function_call`, `logprobs` without `top_logprobs`, and an unknown message role.

Shapes are asserted, not wording: `n > 1` samples (a temperature and a seed), and `ignore_eos`
(llama-server's) makes each choice run to `max_tokens`, so the usage of the whole request is
known: the prompt once, every choice's completion added up.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from tests.e2e.compat.table import covers
from tests.support import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

STORY: list[Any] = [{"role": "user", "content": "Tell me a long story about a cat."}]
SAMPLED: dict[str, Any] = {"temperature": 0.8, "seed": 11, "max_tokens": 6,
                           "extra_body": {"ignore_eos": True}}
GREEDY: dict[str, Any] = {"temperature": 0, "seed": 7}
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
TIME = {"name": "get_time", "description": "The time now",
        "parameters": {"type": "object", "properties": {}}}


@pytest.fixture(scope="module")
def oai(compat_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=compat_server.url + "/v1", api_key="unused", timeout=120,
                         max_retries=0)


@covers("Several choices (n)", "OpenAI")
def test_chat_with_n_2(oai: openai.OpenAI) -> None:
    done = oai.chat.completions.create(model="smollm2", messages=STORY, n=2, **SAMPLED)
    assert [c.index for c in done.choices] == [0, 1]
    assert all(c.message.content and c.finish_reason == "length" for c in done.choices)
    assert done.usage is not None and done.usage.completion_tokens == 12  # 2 x 6, not 6

    chunks = list(oai.chat.completions.create(
        model="smollm2", messages=STORY, n=2, stream=True,
        stream_options={"include_usage": True}, **SAMPLED))
    text: dict[int, str] = {}
    finished = []
    for chunk in chunks:
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.append(c.index)
    assert sorted(text) == [0, 1] and all(text.values())
    assert sorted(finished) == [0, 1]
    usages = [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert len(usages) == 1 and chunks[-1].choices == []
    assert usages[0].completion_tokens == 12


@covers("Several choices (n)", "OpenAI")
def test_completions_with_n_2(oai: openai.OpenAI) -> None:
    done = oai.completions.create(model="smollm2", prompt="Once upon a time", n=2, **SAMPLED)
    assert [c.index for c in done.choices] == [0, 1]
    assert all(c.text for c in done.choices)
    assert done.usage is not None and done.usage.completion_tokens == 12

    streamed: dict[int, str] = {}
    for chunk in oai.completions.create(model="smollm2", prompt="Once upon a time", n=2,
                                        stream=True, **SAMPLED):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert sorted(streamed) == [0, 1] and all(streamed.values())


def test_n_past_the_bound_is_a_400_naming_it(oai: openai.OpenAI) -> None:
    # the suite's llama-server has 4 slots (llama_server_parallel), max_choices is 8
    for n in (5, 9):
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model="smollm2", messages=STORY, n=n, max_tokens=2)
        body: Any = info.value.body
        assert body["param"] == "n" and body["code"] == "invalid_request"


@covers("Legacy functions/function_call", "OpenAI")
def test_legacy_functions_and_a_named_function_call(oai: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Tell me a joke."}]  # nothing asks for a function
    done = oai.chat.completions.create(
        model="smollm2", messages=ask, max_tokens=80, functions=[WEATHER, TIME],  # type: ignore[list-item]
        function_call={"name": "get_time"}, **GREEDY)
    message = done.choices[0].message
    assert message.function_call is not None and message.function_call.name == "get_time"
    assert isinstance(json.loads(message.function_call.arguments), dict)
    assert not message.tool_calls
    assert done.choices[0].finish_reason == "function_call"

    name, arguments, finish = "", "", None
    for chunk in oai.chat.completions.create(
            model="smollm2", messages=ask, max_tokens=80, functions=[WEATHER],  # type: ignore[list-item]
            function_call={"name": "get_weather"}, stream=True, **GREEDY):
        for c in chunk.choices:
            assert not c.delta.tool_calls
            if c.delta.function_call is not None:
                name += c.delta.function_call.name or ""
                arguments += c.delta.function_call.arguments or ""
            finish = c.finish_reason or finish
    assert name == "get_weather" and finish == "function_call"
    assert isinstance(json.loads(arguments), dict)


@covers("Legacy functions/function_call", "OpenAI")
def test_a_legacy_function_result_round_trip(oai: openai.OpenAI) -> None:
    messages: list[Any] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None,
         "function_call": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
        {"role": "function", "name": "get_weather", "content": "Sunny, 24 degrees."}]
    done = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=24,
                                       functions=[WEATHER], function_call="none",  # type: ignore[list-item]
                                       **GREEDY)
    assert done.choices[0].message.content
    assert done.choices[0].message.function_call is None


@covers("Log probabilities", "OpenAI")
def test_logprobs_without_top_logprobs_give_no_alternatives(oai: openai.OpenAI) -> None:
    done = oai.chat.completions.create(model="smollm2", messages=STORY, max_tokens=4,
                                       logprobs=True, **GREEDY)
    content = done.choices[0].logprobs.content if done.choices[0].logprobs else None
    assert content and all(t.top_logprobs == [] and t.logprob <= 0 for t in content)

    streamed = []
    for chunk in oai.chat.completions.create(model="smollm2", messages=STORY, max_tokens=4,
                                             logprobs=True, stream=True, **GREEDY):
        for c in chunk.choices:
            streamed += (c.logprobs.content or []) if c.logprobs else []
    assert streamed and all(t.top_logprobs == [] for t in streamed)


def test_an_unknown_role_is_a_400_naming_it(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="smollm2", max_tokens=2, messages=[
            {"role": "user", "content": "Hi"}, {"role": "robot", "content": "beep"}])  # type: ignore[misc,list-item]
    body: Any = info.value.body
    assert body["param"] == "messages.1.role" and body["code"] == "invalid_request"
    assert "robot" in body["message"]
