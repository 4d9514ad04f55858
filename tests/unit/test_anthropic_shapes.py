"""Anthropic Messages ↔ OpenAI chat (front/chat/anthropic_shapes.py) and the framing of the
answer (front/chat/render_anthropic.py), on parsed JSON: no server."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from modelyard.errors import InvalidRequest, ModelNotFound, QueueFull, UpstreamError
from modelyard.front.chat import anthropic_shapes as shapes
from modelyard.front.chat.render_anthropic import AnthropicRender
from modelyard.front.chat.request import CHAT_PATH, ChatCall
from modelyard.front.chat.translate import Generation
from modelyard.front.render import error_response

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def convert(**body: Any) -> dict[str, Any]:
    return shapes.to_openai({"model": "m", **body}, max_tokens=9, stream=False)


def test_system_blocks_and_text_blocks_become_strings() -> None:
    out = convert(system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                  messages=[{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                         {"type": "text", "text": "there"}]}])
    assert out["messages"] == [{"role": "system", "content": "a\nb"},
                               {"role": "user", "content": "hi\nthere"}]
    assert out["max_tokens"] == 9 and out["stream"] is False and "stream_options" not in out


def test_stream_asks_for_usage() -> None:
    out = shapes.to_openai({"model": "m", "messages": [{"role": "user", "content": "x"}]},
                           max_tokens=1, stream=True)
    assert out["stream_options"] == {"include_usage": True}


def test_tool_use_and_results_in_openai_order() -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "toolu_2", "name": "time", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "text", "text": "sunny"},
                {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "late",
             "is_error": True},
            {"type": "text", "text": "and?"}]},
    ]  # fmt: skip
    out = convert(messages=messages)["messages"]
    assert out[1]["role"] == "assistant" and out[1]["content"] == "Let me look."
    calls = out[1]["tool_calls"]
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls] == [("toolu_1", "weather", {"city": "Oslo"}), ("toolu_2", "time", {})]
    # The tool messages right after the assistant's calls, then the rest of the user's turn.
    assert out[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert out[3] == {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: late"}
    assert out[4] == {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
        {"type": "text", "text": "and?"}]}  # fmt: skip
    assert len(out) == 5


def test_only_tool_results_make_no_empty_user_message() -> None:
    out = convert(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}])["messages"]
    assert out == [{"role": "tool", "tool_call_id": "t", "content": "x"}]


@pytest.mark.parametrize(("choice", "expected", "parallel"), [
    ({"type": "auto"}, "auto", None),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "none"}, "none", None),
    ({"type": "tool", "name": "w"}, {"type": "function", "function": {"name": "w"}}, None),
])  # fmt: skip
def test_tools_and_tool_choice(choice: dict[str, Any], expected: Any, parallel: Any) -> None:
    tool = {"name": "w", "description": "d", "input_schema": {"type": "object"}}
    out = convert(messages=[{"role": "user", "content": "x"}], tools=[tool], tool_choice=choice)
    assert out["tools"] == [{"type": "function", "function": {
        "name": "w", "description": "d", "parameters": {"type": "object"}}}]  # fmt: skip
    assert out["tool_choice"] == expected
    assert out.get("parallel_tool_calls") is parallel


def test_sampling_and_stops_pass() -> None:
    out = convert(messages=[{"role": "user", "content": "x"}], temperature=0.2, top_p=0.9,
                  top_k=5, stop_sequences=["END"], metadata={"user_id": "u"})
    assert (out["temperature"], out["top_p"], out["top_k"], out["stop"]) == (0.2, 0.9, 5,
                                                                            ["END"])
    assert "metadata" not in out


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "text/plain", "data": "eA=="}}]}]},
     "messages.0.content.0.source.media_type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "file", "file_id": "f"}}]}]}, "messages.0.content.0.source.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b",
                                                 "input": {}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages.0.content.0.tool_use_id"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "w"}]},
     "tools.0.input_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}},
     "tool_choice.name"),
    ({"messages": [{"role": "user", "content": "x"}], "system": [{"type": "image"}]},
     "system.0"),
    ({"messages": [{"role": "user", "content": "x"}], "output_config": {"format": {
        "type": "json_schema"}}}, "output_config.format"),
])  # fmt: skip
def test_malformed_blocks_are_400s_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        convert(**body)
    assert refused.value.param == param


@pytest.mark.parametrize(("thinking", "ok"), [
    ({"type": "enabled", "budget_tokens": 2048}, True),
    ({"type": "enabled", "budget_tokens": 512}, False),
    ({"type": "enabled", "budget_tokens": 4096}, False),  # not below max_tokens
    ({"type": "disabled"}, True), ({"type": "adaptive"}, True), ({"type": "other"}, False),
])  # fmt: skip
def test_thinking_validated_like_anthropic(thinking: dict[str, Any], ok: bool) -> None:
    if ok:
        shapes.check_thinking(thinking, 4096)
    else:
        with pytest.raises(InvalidRequest):
            shapes.check_thinking(thinking, 4096)


def test_errors_take_anthropics_shape_on_its_paths() -> None:
    r = error_response("/v1/messages", ModelNotFound("x"))
    assert r.status_code == 404
    assert orjson.loads(r.body) == {"type": "error", "error": {
        "type": "not_found_error", "message": ModelNotFound("x").message}}  # fmt: skip
    r = error_response("/v1/messages/count_tokens", QueueFull("full", retry_after_s=2))
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert orjson.loads(r.body)["error"]["type"] == "rate_limit_error"
    # Other /v1 paths keep OpenAI's.
    assert "code" in orjson.loads(error_response("/v1/chat/completions", QueueFull("f")).body)[
        "error"]
    assert shapes.error_type(503) == "overloaded_error"
    assert shapes.error_type(502) == "api_error" and shapes.error_type(415) == (
        "invalid_request_error")


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


CALL = ChatCall("anthropic", "/v1/messages", "m", CHAT_PATH, True, {})


def test_stream_with_text_then_tool_use() -> None:
    render, gen = AnthropicRender(), Generation.start()
    raw = render.text(CALL, gen, "Hi")
    raw += render.text(CALL, gen, " there")
    gen.tool_calls = {0: {"id": "call_1", "name": "w", "arguments": '{"city": "Oslo"}'}}
    gen.finish_reason, gen.prompt_tokens, gen.completion_tokens = "tool_calls", 7, 4
    raw += render.done(CALL, gen)
    got = events(raw)
    assert [n for n, _ in got] == [
        "message_start", "content_block_start", "ping", "content_block_delta",
        "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert got[0][1]["message"]["id"] == render.id and got[0][1]["message"]["content"] == []
    assert got[6][1] == {"type": "content_block_start", "index": 1, "content_block": {
        "type": "tool_use", "id": "toolu_1", "name": "w", "input": {}}}  # fmt: skip
    assert json.loads(got[7][1]["delta"]["partial_json"]) == {"city": "Oslo"}
    assert got[9][1]["delta"]["stop_reason"] == "tool_use"
    assert got[9][1]["usage"] == {"input_tokens": 7, "cache_read_input_tokens": 0,
                                  "cache_creation_input_tokens": 0, "output_tokens": 4}


def test_stream_without_text_and_in_band_error() -> None:
    render, gen = AnthropicRender(), Generation.start()
    gen.finish_reason = "length"
    got = events(render.done(CALL, gen))
    assert [n for n, _ in got] == ["message_start", "message_delta", "message_stop"]
    assert got[1][1]["delta"]["stop_reason"] == "max_tokens"
    name, data = events(render.error_event(UpstreamError("broke")))[0]
    assert name == "error" and data == {"type": "error", "error": {"type": "api_error",
                                                                   "message": "broke"}}


def test_whole_message() -> None:
    gen = Generation.start()
    gen.absorb({"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "ok"}}], "usage": {"prompt_tokens": 3,
                                                          "completion_tokens": 1}})  # fmt: skip
    body = orjson.loads(AnthropicRender().whole(CALL, gen).body)
    assert body["content"] == [{"type": "text", "text": "ok"}]
    assert body["stop_reason"] == "end_turn" and body["usage"] == {
        "input_tokens": 3, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0,
        "output_tokens": 1}


def test_cached_prompt_tokens_are_apart_as_anthropic_counts_them() -> None:
    gen = Generation.start()
    gen.absorb({"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "ok"}}], "usage": {
            "prompt_tokens": 30, "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 24}}})  # fmt: skip
    usage = orjson.loads(AnthropicRender().whole(CALL, gen).body)["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (6, 24)
