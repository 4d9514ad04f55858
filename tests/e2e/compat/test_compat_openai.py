"""The official `openai` SDK, unchanged, against modelyard on its embedded defaults."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from tests.e2e.compat.table import covers
from tests.support import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PROMPT: list[Any] = [{"role": "user", "content": "Name one colour of the rainbow."}]
# Greedy wherever an assertion reads what the demo model wrote (its text, a tool call's JSON):
# sampled, it may end at once (empty content) or run a JSON argument past max_tokens.
GREEDY: dict[str, Any] = {"temperature": 0, "seed": 7}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "The time now",
                 "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def oai(compat_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=compat_server.url + "/v1", api_key="unused", timeout=120,
                         max_retries=0)


@covers("Chat: system prompt, multi-turn", "OpenAI")
def test_chat_multi_turn(oai: openai.OpenAI) -> None:
    answer = oai.chat.completions.create(
        model="smollm2", max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "You answer in one word."},
                  {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                  {"role": "user", "content": "Name a colour."}])
    assert answer.choices[0].message.content
    assert answer.model == "smollm2"


@covers("Model names with and without `:latest`", "OpenAI")
@covers("Model listing and details", "OpenAI")
def test_tagged_name_is_the_same_model(oai: openai.OpenAI) -> None:
    answer = oai.chat.completions.create(model="smollm2:latest", messages=PROMPT, max_tokens=4,
                                         **GREEDY)
    assert answer.choices[0].message.content is not None
    assert "smollm2" in [m.id for m in oai.models.list().data]


@covers("Streaming", "OpenAI")
@covers("Token usage (all prompt tokens)", "OpenAI")
def test_stream_with_include_usage(compat_server: Server, oai: openai.OpenAI) -> None:
    chunks = list(oai.chat.completions.create(
        model="smollm2", messages=PROMPT, max_tokens=8, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.prompt_tokens > 5
    # As OpenAI documents: every other chunk says `"usage": null`, it does not leave it out.
    body = {"model": "smollm2", "messages": PROMPT, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", compat_server.url + "/v1/chat/completions", json=body,
                      timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert all("usage" in e for e in events)
    assert all(e["usage"] is None for e in events if e["choices"])
    # The same prompt again is cached by llama-server: the count is still the whole prompt.
    again = list(oai.chat.completions.create(
        model="smollm2", messages=PROMPT, max_tokens=8, stream=True,
        stream_options={"include_usage": True}))[-1]
    assert again.usage is not None and again.usage.prompt_tokens == last.usage.prompt_tokens


@covers("Seed, stop sequences, temperature", "OpenAI")
def test_seed_and_stop(oai: openai.OpenAI) -> None:
    def ask() -> str:
        a = oai.chat.completions.create(model="smollm2", messages=PROMPT, max_tokens=16,
                                        seed=7, temperature=1.0)
        return a.choices[0].message.content or ""

    assert ask() == ask()
    stopped = oai.chat.completions.create(
        model="smollm2", max_tokens=32, temperature=0, stop=["3"],
        messages=[{"role": "user", "content": "Count: 1, 2, 3, 4, 5. Repeat the count."}])
    assert "3" not in (stopped.choices[0].message.content or "")


@covers("Log probabilities", "OpenAI")
def test_logprobs_in_both_shapes(oai: openai.OpenAI) -> None:
    chat = oai.chat.completions.create(model="smollm2", messages=PROMPT, max_tokens=3,
                                       logprobs=True, top_logprobs=2, **GREEDY)
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    # The legacy completions shape: parallel arrays, not the chat objects.
    text = oai.completions.create(model="smollm2", prompt="The sky is", max_tokens=3,
                                  logprobs=2, temperature=0)
    lp = text.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert isinstance(lp.top_logprobs[0], dict) and len(lp.top_logprobs[0]) == 2
    assert lp.text_offset is not None and len(lp.text_offset) == len(lp.tokens)


@covers("Text completion", "OpenAI")
def test_completions_echo(oai: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    echoed = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=4, echo=True,
                                    temperature=0)
    plain = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=4,
                                   temperature=0)
    assert echoed.choices[0].text == prompt + plain.choices[0].text


@covers("Structured output (JSON schema)", "OpenAI")
def test_response_format_json_schema(oai: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string"},
                                               "count": {"type": "integer"}},
              "required": ["colour", "count"], "additionalProperties": False}
    answer = oai.chat.completions.create(
        model="smollm2", messages=PROMPT, max_tokens=60, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "c", "schema": schema, "strict": True}})
    data = json.loads(answer.choices[0].message.content or "")
    assert isinstance(data["colour"], str) and isinstance(data["count"], int)


@covers("Tools: tool_choice required and named", "OpenAI")
def test_tool_choice_required_and_named(oai: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Tell me a joke."}]  # nothing asks for a tool
    required = oai.chat.completions.create(model="smollm2", messages=ask, max_tokens=80,
                                           tools=[WEATHER], tool_choice="required", **GREEDY)
    calls = required.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    json.loads(calls[0].function.arguments)
    named = oai.chat.completions.create(
        model="smollm2", messages=ask, max_tokens=80, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, **GREEDY)
    calls = named.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_time"
    assert required.choices[0].finish_reason == "tool_calls"


@covers("Tools: calls and results round trip", "OpenAI")
def test_tool_result_round_trip(oai: openai.OpenAI) -> None:
    messages: list[Any] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    answer = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=20,
                                         tools=[WEATHER], **GREEDY)
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


@covers("Context overflow is recognisable", "OpenAI")
def test_context_length_exceeded(oai: openai.OpenAI) -> None:
    long = "word " * 5000
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="smollm2", max_tokens=4,
                                    messages=[{"role": "user", "content": long}])
    assert err.value.code == "context_length_exceeded"
    assert "tokens" in str(err.value.message)


@covers("Embeddings", "OpenAI")
def test_embeddings_out_of_the_box(oai: openai.OpenAI) -> None:
    out = oai.embeddings.create(model="all-minilm", input=["a cat", "a dog"])
    assert len(out.data) == 2 and len(out.data[0].embedding) == 384
    with pytest.raises(openai.BadRequestError) as err:
        oai.embeddings.create(model="smollm2", input="a cat")
    assert "all-minilm" in str(err.value.message)


@covers("Errors in the API's own shape", "OpenAI")
def test_unknown_model_is_a_404_in_openai_shape(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="no-such-model", messages=PROMPT, max_tokens=2)
    assert err.value.code


@covers("Images (vision)", "OpenAI")
def test_image_on_a_model_without_vision_is_a_clear_400(oai: openai.OpenAI) -> None:
    pixel = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42"
             "mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="smollm2", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": pixel}}]}])
    assert "image" in str(err.value.message).lower()
