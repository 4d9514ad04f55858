"""A forced tool call on llama-server: the request asks for a JSON schema of exactly one call,
and the answer's JSON text becomes OpenAI's `tool_calls`, whole or streamed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from modelyard.front.chat.forced_call import plan

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time"}}]


def request(choice: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [], "tools": TOOLS, "tool_choice": choice,
            "parallel_tool_calls": True}


def chunk(content: str | None = None, finish: str | None = None,
          usage: dict[str, int] | None = None) -> dict[str, Any]:
    delta = {} if content is None else {"content": content}
    out: dict[str, Any] = {"id": "c", "object": "chat.completion.chunk",
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        out["usage"] = usage
    return out


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_a_choice_that_forces_nothing_changes_nothing(choice: Any) -> None:
    assert plan(request(choice)) is None


def test_required_admits_one_call_of_any_tool_and_keeps_the_tools_for_the_prompt() -> None:
    planned = plan(request("required"))
    assert planned is not None
    payload, force = planned
    assert payload["tools"] == TOOLS and payload["tool_choice"] == "none"
    assert "parallel_tool_calls" not in payload
    schema = payload["response_format"]["json_schema"]["schema"]
    assert [s["properties"]["name"] for s in schema["anyOf"]] == [
        {"const": "get_weather"}, {"const": "get_time"}]
    assert schema["anyOf"][0]["properties"]["arguments"] == PARAMS
    assert schema["anyOf"][1]["properties"]["arguments"] == {"type": "object"}
    assert force.names == {"get_weather", "get_time"}


def test_a_named_function_admits_only_it() -> None:
    planned = plan(request({"type": "function", "function": {"name": "get_time"}}))
    assert planned is not None
    schema = planned[0]["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["name"] == {"const": "get_time"}
    assert plan(request({"type": "function", "function": {"name": "absent"}})) is None


def test_a_whole_answer_becomes_the_call() -> None:
    planned = plan(request("required"))
    assert planned is not None
    force = planned[1]
    text = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    answer = {"choices": [{"index": 0, "finish_reason": "stop",
                           "message": {"role": "assistant", "content": text}}]}
    choice = force.whole(answer)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_a_stream_holds_the_text_and_sends_the_call_at_the_finish() -> None:
    planned = plan(request({"type": "function", "function": {"name": "get_weather"}}))
    assert planned is not None
    force = planned[1]
    text = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    sent = [e for part in (text[:7], text[7:20], text[20:]) for e in force.events(chunk(part))]
    assert sent == []  # nothing of the JSON text reaches the client
    last = force.events(chunk(finish="stop", usage={"prompt_tokens": 9}))
    call_chunk, finish_chunk = last
    delta = call_chunk["choices"][0]["delta"]
    assert delta["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(delta["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert "usage" not in call_chunk
    assert finish_chunk["choices"][0]["finish_reason"] == "tool_calls"
    assert finish_chunk["usage"] == {"prompt_tokens": 9}


def test_an_answer_cut_short_is_sent_as_the_text_it_is() -> None:
    planned = plan(request("required"))
    assert planned is not None
    force = planned[1]
    assert force.events(chunk('{"name": "get_wea')) == []
    (out,) = force.events(chunk(finish="length"))
    assert out["choices"][0]["delta"]["content"] == '{"name": "get_wea'
    assert out["choices"][0]["finish_reason"] == "length"
