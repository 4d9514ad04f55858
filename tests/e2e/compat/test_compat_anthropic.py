"""The official `anthropic` SDK, unchanged, against modelyard's Messages API."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest
from tests.e2e.compat.table import covers
from tests.support import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

WEATHER: Any = {"name": "get_weather", "description": "The weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}
# Greedy wherever an assertion reads what the demo model wrote: sampled, it may end at once (no
# text block) or run a tool call's JSON past max_tokens. (anthropic 2.x dropped `temperature`
# from its signature, and the API has no seed: it goes as an extra field.)
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(compat_server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=compat_server.url, api_key="unused", timeout=120,
                               max_retries=0)


@covers("Chat: system prompt, multi-turn", "Anthropic")
@covers("Token usage (all prompt tokens)", "Anthropic")
@covers("Model names with and without `:latest`", "Anthropic")
@covers("Count tokens", "Anthropic")
def test_messages(claude: anthropic.Anthropic) -> None:
    msg = claude.messages.create(
        model="smollm2", max_tokens=8, system="Answer in one word.", extra_body=GREEDY,
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                  {"role": "user", "content": "Name a colour."}])
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens")
    # Anthropic counts the tokens read from the (llama-server's) cache apart.
    prompt = msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    assert prompt > 5 and msg.usage.output_tokens > 0
    counted = claude.messages.count_tokens(
        model="smollm2:latest", system="Answer in one word.",
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                  {"role": "user", "content": "Name a colour."}])
    assert counted.input_tokens == prompt
    again = claude.messages.create(model="smollm2", max_tokens=8, system="Answer in one word.",
                                   messages=[{"role": "user", "content": "Name a colour."}])
    assert (again.usage.cache_read_input_tokens or 0) > 0  # the system prompt was cached


@covers("Streaming", "Anthropic")
def test_stream_events_in_order(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model="smollm2", max_tokens=8, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Say hello."}]) as s:
        types = [event.type for event in s]
        final = s.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert types.index("content_block_start") < types.index("content_block_stop")
    assert "message_delta" in types
    assert final.content[0].type == "text" and final.content[0].text


@covers("Seed, stop sequences, temperature", "Anthropic")
def test_stop_sequences(claude: anthropic.Anthropic) -> None:
    msg = claude.messages.create(
        model="smollm2", max_tokens=32, extra_body=GREEDY, stop_sequences=["3"],
        messages=[{"role": "user", "content": "Count: 1, 2, 3, 4, 5. Repeat the count."}])
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert "3" not in text
    assert msg.stop_reason in ("stop_sequence", "end_turn", "max_tokens")


@covers("Tools: tool_choice required and named", "Anthropic")
@covers("Tools: calls and results round trip", "Anthropic")
def test_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    asked = claude.messages.create(
        model="smollm2", max_tokens=80, tools=[WEATHER], extra_body=GREEDY,
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    uses = [b for b in asked.content if b.type == "tool_use"]
    assert asked.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert isinstance(uses[0].input, dict)
    answered = claude.messages.create(
        model="smollm2", max_tokens=20, tools=[WEATHER], extra_body=GREEDY,
        messages=[{"role": "user", "content": "What is the weather in Paris?"},
                  {"role": "assistant", "content": asked.content},  # type: ignore[typeddict-item]
                  {"role": "user", "content": [{"type": "tool_result",
                                                "tool_use_id": uses[0].id,
                                                "content": "Sunny, 21 C"}]}])
    assert answered.content


@covers("Errors in the API's own shape", "Anthropic")
def test_errors_in_anthropic_shape(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="no-such-model", max_tokens=2,
                               messages=[{"role": "user", "content": "Hi"}])
    assert err.value.body["type"] == "error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="smollm2", max_tokens=2, messages=[])


@covers("Images (vision)", "Anthropic")
def test_image_on_a_model_without_vision_is_a_clear_400(claude: anthropic.Anthropic) -> None:
    pixel = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAAB"
             "JRU5ErkJggg==")
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="smollm2", max_tokens=4, messages=[
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": pixel}},
                {"type": "text", "text": "What is this?"}]}])
    assert "image" in str(err.value.message).lower()
