"""The official `openai` SDK's Responses API against modelyard."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from tests.e2e.compat.table import covers
from tests.support import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

WEATHER: Any = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}
# Greedy wherever an assertion reads what the demo model wrote (the Responses API takes no
# seed): sampled, it may end at once (no output_text) or run a call's JSON past the limit.
GREEDY: dict[str, Any] = {"temperature": 0}


@pytest.fixture(scope="module")
def oai(compat_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=compat_server.url + "/v1", api_key="unused", timeout=120,
                         max_retries=0)


@covers("Responses API: create, instructions, stored chain", "OpenAI")
def test_create_and_continue(oai: openai.OpenAI) -> None:
    first = oai.responses.create(model="smollm2", instructions="Answer in one word.",
                                 input="Name a colour of the rainbow.", max_output_tokens=8,
                                 **GREEDY)
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.usage is not None and first.usage.input_tokens > 5
    follow = oai.responses.create(model="smollm2", input="And another one?",
                                  previous_response_id=first.id, max_output_tokens=8)
    # The chain's history is on the server: the follow-up's prompt holds the first turn too.
    assert follow.usage is not None and follow.usage.input_tokens > first.usage.input_tokens
    assert oai.responses.retrieve(first.id).id == first.id
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="smollm2", input="Hi", previous_response_id="resp_missing")


@covers("Responses API: streaming events", "OpenAI")
def test_stream_events(oai: openai.OpenAI) -> None:
    stream = oai.responses.create(model="smollm2", input="Say hello.", max_output_tokens=8,
                                  stream=True, **GREEDY)
    events = list(stream)
    types = [event.type for event in events]
    assert types[0] == "response.created" and types[1] == "response.in_progress"
    # Cut by max_output_tokens, or not: it ends as OpenAI's does, with the whole response.
    assert types[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in types
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


@covers("Responses API: function tools", "OpenAI")
def test_function_tool_round_trip(oai: openai.OpenAI) -> None:
    asked = oai.responses.create(model="smollm2", input="What is the weather in Paris?",
                                 tools=[WEATHER], tool_choice="required", max_output_tokens=60,
                                 **GREEDY)
    calls = [item for item in asked.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    answered = oai.responses.create(
        model="smollm2", previous_response_id=asked.id, tools=[WEATHER], max_output_tokens=20,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "Sunny, 21 C"}])
    assert answered.status in ("completed", "incomplete")
