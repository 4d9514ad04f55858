"""The Responses API's request and answer shapes (front/chat/responses_shapes.py) and its
event framing (front/chat/render_responses.py), without a server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from modelyard.errors import InvalidRequest, UpstreamError
from modelyard.front.chat.render_responses import ResponsesRender
from modelyard.front.chat.request import CHAT_PATH, ChatCall
from modelyard.front.chat.responses_shapes import (
    chat_tool_choice,
    input_messages,
    response_format,
    response_head,
)
from modelyard.front.chat.translate import Generation

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def test_parallel_function_calls_are_one_assistant_message() -> None:
    messages = input_messages([
        {"role": "user", "content": "both?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{\"x\":1}"},
        {"type": "function_call_output", "call_id": "a",
         "output": [{"type": "input_text", "text": "A"}]},
        {"type": "function_call_output", "call_id": "b", "output": "B"},
    ])  # fmt: skip
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["a", "b"]
    assert messages[2] == {"role": "tool", "tool_call_id": "a", "content": "A"}


def test_shapes_map_to_chat_fields() -> None:
    assert input_messages([{"role": "developer", "content": "x"}]) == [
        {"role": "system", "content": "x"}]
    assert chat_tool_choice({"type": "function", "name": "f"}) == {
        "type": "function", "function": {"name": "f"}}
    assert response_format({"format": {"type": "json_object"}}) == {"type": "json_object"}
    assert response_format({"format": {"type": "text"}}) is None


def test_a_function_call_without_a_name_is_refused() -> None:
    with pytest.raises(InvalidRequest) as err:
        input_messages([{"type": "function_call", "call_id": "a", "arguments": "{}"}])
    assert err.value.param == "input.0"


def events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines()
            if line.startswith("data: ")]


def call() -> ChatCall:
    return ChatCall("openai", "/v1/responses", "m", CHAT_PATH, True, {})


def test_text_then_tool_call_events() -> None:
    finals: list[dict[str, Any]] = []
    render = ResponsesRender(response_head("resp_1", "m", {}, store=True), finals.append)
    gen = Generation.start()
    gen.absorb({"choices": [{"index": 0, "delta": {"content": "Hi", "tool_calls": [
        {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": "{}"}}]},
        "finish_reason": "tool_calls"}]})  # fmt: skip
    out = events(render.text(call(), gen, "Hi") + render.done(call(), gen))
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert [e.get("output_index") for e in out if e["type"].startswith("response.output_item")
            ] == [0, 0, 1, 1]
    final = out[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["call_id"] == "call_1" and finals == [final]


def test_an_error_before_any_text_still_opens_the_stream() -> None:
    render = ResponsesRender(response_head("resp_1", "m", {}, store=False))
    out = events(render.error_event(UpstreamError("backend broke")))
    assert [e["type"] for e in out] == ["response.created", "response.in_progress", "error",
                                        "response.failed"]
    assert out[-1]["response"]["error"]["message"] == "backend broke"
