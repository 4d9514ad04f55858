"""OpenAI requests llama-server reads differently (issue 32): several choices (`n`,
front/chat/choices.py), the legacy `functions` / `function_call` (front/chat/legacy_functions.py),
`logprobs: true` without `top_logprobs`, and an unknown message role. The reshaping runs over
llama-server's shapes (as its source writes them) split anywhere, as the network delivers them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from modelyard.config import LlamaCppModel, OpenAIServerModel
from modelyard.errors import InvalidRequest
from modelyard.front.api.anthropic import MessagesRequest
from modelyard.front.api.ollama import ChatRequest as OllamaChatRequest
from modelyard.front.api.openai import ChatCompletionRequest
from modelyard.front.chat import choices, legacy_functions
from modelyard.front.chat.openai_compat import Reshape, prepare
from modelyard.front.chat.shapes import check_roles
from modelyard.front.state import validate

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HEAD = {"id": "chatcmpl-x", "created": 1, "model": "m", "object": "chat.completion.chunk"}


def chunk(index: int, delta: dict[str, Any] | None = None, finish: str | None = None,
          **extra: Any) -> dict[str, Any]:
    return {**HEAD, "choices": [{"index": index, "delta": delta or {},
                                 "finish_reason": finish}], **extra}


def usage(completion: int, cached: int) -> dict[str, Any]:
    return {**HEAD, "choices": [], "usage": {
        "prompt_tokens": 9, "completion_tokens": completion, "total_tokens": 9 + completion,
        "prompt_tokens_details": {"cached_tokens": cached}},
        "timings": {"prompt_n": 9 - cached, "cache_n": cached, "predicted_n": completion,
                    "prompt_ms": 1.0, "predicted_ms": 2.0}}


# llama-server's stream for n=2 with include_usage: each choice its own finish and usage.
TWO = [chunk(0, {"role": "assistant", "content": None}), chunk(1, {"role": "assistant",
       "content": None}), chunk(0, {"content": "Hel"}), chunk(1, {"content": "Yo"}),
       chunk(0, {"content": "lo"}), chunk(0, finish="stop"), usage(3, 0),
       chunk(1, finish="length"), usage(2, 9)]


def sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


async def _split(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


def streamed(reshape: Reshape, data: bytes, size: int = 7) -> list[Any]:
    async def run() -> bytes:
        return b"".join([c async for c in reshape.stream(_split(data, size))])

    out = asyncio.run(run())
    assert out.endswith(b"data: [DONE]\n\n")
    return [orjson.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: {")]


# ---- n ------------------------------------------------------------------------------------------


def test_n_is_bounded_by_the_setting_and_a_llama_cpp_models_slots() -> None:
    gguf = LlamaCppModel(id="g", path="/m.gguf")
    assert choices.check_n(None, max_choices=8, spec=gguf, slots=4) == 1
    assert choices.check_n(4, max_choices=8, spec=gguf, slots=4) == 4
    with pytest.raises(InvalidRequest) as info:
        choices.check_n(5, max_choices=8, spec=gguf, slots=4)
    assert info.value.param == "n" and "llama_server_parallel" in info.value.message
    other = OpenAIServerModel(id="s", argv=["serve"], path=None)
    assert choices.check_n(8, max_choices=8, spec=other, slots=4) == 8
    with pytest.raises(InvalidRequest) as info:
        choices.check_n(9, max_choices=8, spec=other, slots=4)
    assert "max_choices" in info.value.message


def test_a_whole_answer_of_several_choices_is_asked_as_a_stream_and_assembled() -> None:
    prepared = prepare(CHAT, {"model": "m", "messages": [], "n": 2}, chat=True, n=2)
    assert prepared is not None and prepared.reshape is not None
    assert prepared.payload["stream"] is True
    assert prepared.payload["stream_options"] == {"include_usage": True}
    whole = orjson.loads(prepared.reshape.whole(sse(TWO)))
    assert whole["object"] == "chat.completion"
    assert [(c["index"], c["message"]["content"], c["finish_reason"])
            for c in whole["choices"]] == [(0, "Hello", "stop"), (1, "Yo", "length")]
    # the prompt once, its real reuse (the first choice's), the completions added up
    assert whole["usage"] == {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    assert whole["timings"]["predicted_n"] == 5


@pytest.mark.parametrize("size", [1, 7, 4096])
def test_a_stream_of_several_choices_sends_one_usage_at_the_end(size: int) -> None:
    data = {"model": "m", "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    prepared = prepare(CHAT, data, chat=True, n=2)
    assert prepared is not None and prepared.reshape is not None
    events = streamed(prepared.reshape, sse(TWO), size)
    usages = [e["usage"] for e in events if e.get("usage") is not None]
    assert len(usages) == 1 and events[-1]["choices"] == [] and events[-1]["usage"] == usages[0]
    assert usages[0]["completion_tokens"] == 5 and usages[0]["prompt_tokens"] == 9
    assert all("usage" in e for e in events)  # OpenAI's `usage: null` on the others
    finishes = [(c["index"], c["finish_reason"]) for e in events for c in e["choices"]
                if c["finish_reason"]]
    assert finishes == [(0, "stop"), (1, "length")]


def test_without_include_usage_the_last_finish_carries_the_summed_timings() -> None:
    prepared = prepare(CHAT, {"model": "m", "n": 2, "stream": True}, chat=True, n=2)
    assert prepared is not None and prepared.reshape is not None
    assert prepared.payload["stream_options"] == {"include_usage": True}  # asked upstream
    events = streamed(prepared.reshape, sse(TWO))
    assert not any("usage" in e for e in events)
    assert [e for e in events if "timings" in e] == [events[-1]]
    assert events[-1]["timings"]["predicted_n"] == 5
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_echo_with_several_choices_gives_each_its_prompt() -> None:
    prepared = prepare(COMPLETIONS, {"model": "m", "prompt": ["A", "B"], "echo": True, "n": 2},
                       chat=False, n=2)
    assert prepared is not None and prepared.reshape is not None
    head = {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m"}
    events = [{**head, "choices": [{"index": i, "text": f"{i}", "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 1, "completion_tokens": 1}} for i in range(4)]
    whole = orjson.loads(prepared.reshape.whole(sse(events)))
    assert [c["text"] for c in whole["choices"]] == ["A0", "A1", "B2", "B3"]
    assert whole["usage"]["completion_tokens"] == 4


# ---- legacy functions ---------------------------------------------------------------------------

WEATHER = {"name": "weather", "parameters": {"type": "object"}}


def test_functions_become_tools_and_function_call_a_tool_choice() -> None:
    data = {"messages": [
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": None,
         "function_call": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}},
        {"role": "function", "name": "weather", "content": "sunny"}],
        "functions": [WEATHER], "function_call": {"name": "weather"}}
    assert legacy_functions.used(data) and legacy_functions.answers_legacy(data)
    assert check_roles(data["messages"])
    out = legacy_functions.to_tools(data)
    assert "functions" not in out and "function_call" not in out
    assert out["tools"] == [{"type": "function", "function": WEATHER}]
    assert out["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    call = out["messages"][1]["tool_calls"][0]
    assert call["function"] == {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}
    assert out["messages"][2] == {"role": "tool", "tool_call_id": call["id"],
                                  "name": "weather", "content": "sunny"}
    for choice in ("none", "auto"):
        assert legacy_functions.to_tools({"function_call": choice})["tool_choice"] == choice


@pytest.mark.parametrize(("data", "param"), [
    ({"functions": {"name": "x"}}, "functions"),
    ({"functions": [WEATHER], "tools": []}, "functions"),
    ({"function_call": "required"}, "function_call"),
    ({"function_call": {"nom": "x"}}, "function_call"),
])
def test_malformed_legacy_fields_are_a_400_naming_them(data: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        legacy_functions.to_tools(data)
    assert info.value.param == param


def test_plain_requests_are_not_legacy() -> None:
    data = {"messages": [{"role": "user", "content": "x"}], "tools": []}
    assert not legacy_functions.used(data) and not check_roles(data["messages"])


def test_the_answer_goes_back_as_function_call() -> None:
    prepared = prepare(CHAT, {"model": "m"}, chat=True, legacy=True)
    assert prepared is not None and prepared.reshape is not None
    answer = {**HEAD, "object": "chat.completion", "choices": [{
        "index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "weather", "arguments": "{}"}}]}}]}
    choice = orjson.loads(prepared.reshape.whole(orjson.dumps(answer)))["choices"][0]
    assert choice["finish_reason"] == "function_call"
    assert choice["message"]["function_call"] == {"name": "weather", "arguments": "{}"}
    assert "tool_calls" not in choice["message"]


def test_a_streamed_call_goes_back_as_function_call_deltas() -> None:
    prepared = prepare(CHAT, {"model": "m", "stream": True}, chat=True, legacy=True)
    assert prepared is not None and prepared.reshape is not None
    calls = [chunk(0, {"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                       "function": {"name": "weather", "arguments": ""}}]}),
             chunk(0, {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
             chunk(0, finish="tool_calls")]
    events = streamed(prepared.reshape, sse(calls))
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["function_call"] == {"name": "weather", "arguments": ""}
    assert deltas[1]["function_call"] == {"arguments": "{}"}
    assert not any("tool_calls" in d for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "function_call"


# ---- logprobs without top_logprobs ------------------------------------------------------------

TOKEN = {"id": 1, "token": "Hi", "logprob": -0.5, "bytes": [72, 105],
         "top_logprobs": [{"id": 1, "token": "Hi", "logprob": -0.5, "bytes": [72, 105]}]}


@pytest.mark.parametrize("top", [None, 0])
def test_logprobs_without_top_logprobs_ask_one_and_give_none(top: int | None) -> None:
    data: dict[str, Any] = {"model": "m", "logprobs": True}
    if top is not None:
        data["top_logprobs"] = top
    prepared = prepare(CHAT, data, chat=True)
    assert prepared is not None and prepared.reshape is not None
    assert prepared.payload["top_logprobs"] == 1  # llama-server: 20 unset, nothing at all for 0
    answer = {**HEAD, "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "Hi"}, "logprobs": {"content": [dict(TOKEN)]}}]}
    (item,) = orjson.loads(prepared.reshape.whole(orjson.dumps(answer)))["choices"][0][
        "logprobs"]["content"]
    assert item["top_logprobs"] == [] and item["logprob"] == -0.5


def test_logprobs_with_top_logprobs_pass_through() -> None:
    assert prepare(CHAT, {"model": "m", "logprobs": True, "top_logprobs": 2}, chat=True) is None


# ---- message roles ----------------------------------------------------------------------------


def test_an_unknown_role_is_a_400_naming_it() -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]
    validate(ChatCompletionRequest, {"model": "m", "messages": messages})  # a string: the shape
    with pytest.raises(InvalidRequest) as info:
        check_roles(messages)
    assert info.value.param == "messages.1.role"
    assert "'robot'" in info.value.message and info.value.code == "invalid_request"


def test_openais_roles_are_accepted_and_the_legacy_ones_noticed() -> None:
    plain = [{"role": r, "content": "x"} for r in ("system", "developer", "user", "assistant",
                                                    "tool")]
    assert check_roles(plain) is False
    assert check_roles([*plain, {"role": "function", "name": "f", "content": "1"}]) is True
    assert check_roles([{"role": "assistant", "function_call": {"name": "f"}}]) is True


@pytest.mark.parametrize(("model", "body"), [
    # Ollama's and Anthropic's own roles (system/user/assistant/tool; user/assistant) only
    (OllamaChatRequest, {"model": "m", "messages": [{"role": "developer", "content": "x"}]}),
    (MessagesRequest, {"model": "m", "max_tokens": 1,
                       "messages": [{"role": "system", "content": "x"}]}),
])
def test_the_other_apis_refuse_roles_they_do_not_have(model: Any, body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as info:
        validate(model, body)
    assert info.value.param == "messages.0.role"


# ---- a forced call with several choices -------------------------------------------------------


def test_a_forced_call_in_each_of_several_choices() -> None:
    from modelyard.front.chat.forced_call import ForcedCall

    call = '{"name": "f", "arguments": {"x": 1}}'
    events = [chunk(0, {"content": call[:9]}), chunk(1, {"content": call[:20]}),
              chunk(1, {"content": call[20:]}), chunk(0, {"content": call[9:]}),
              chunk(1, finish="stop"), usage(12, 0), chunk(0, finish="stop"), usage(12, 9)]
    for stream in (False, True):
        prepared = prepare(CHAT, {"model": "m", "stream": stream}, chat=True, n=2)
        assert prepared is not None and prepared.reshape is not None
        prepared.reshape.forced = ForcedCall(frozenset({"f"}))
        if stream:
            out = streamed(prepared.reshape, sse(events))
            calls = {c["index"]: c["delta"]["tool_calls"][0] for e in out for c in e["choices"]
                     if c["delta"].get("tool_calls")}
            finishes = {c["index"]: c["finish_reason"] for e in out for c in e["choices"]
                        if c["finish_reason"]}
        else:
            whole = orjson.loads(prepared.reshape.whole(sse(events)))
            calls = {c["index"]: c["message"]["tool_calls"][0] for c in whole["choices"]}
            finishes = {c["index"]: c["finish_reason"] for c in whole["choices"]}
            assert whole["usage"]["completion_tokens"] == 24
        assert sorted(calls) == [0, 1] and finishes == {0: "tool_calls", 1: "tool_calls"}
        assert all(c["function"]["name"] == "f" for c in calls.values())
        assert calls[0]["id"] != calls[1]["id"]
