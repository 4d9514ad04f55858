"""The transformers server's answer when the model's output holds tool calls: the real
`Completion` (server.py) over a scripted token stream, whole and streamed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from modelyard.engine.backends.transformers.generator import TokenEvent
from modelyard.engine.backends.transformers.server import Completion

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
PIECES = ["Sure. ", "<tool", "_call>", '{"name": "weather", ', '"arguments": {"city": "Oslo"}}',
          "</tool_call>"]


async def scripted(pieces: list[str]) -> AsyncIterator[TokenEvent]:
    for n, text in enumerate(pieces):
        last = n == len(pieces) - 1
        yield TokenEvent(text=text, token_ids=[n], logprobs=None,
                         finish_reason="stop" if last else None,
                         usage={"prompt_tokens": 3, "completion_tokens": len(pieces)}
                         if last else None,
                         timings={} if last else None)


def body(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **extra}


def test_whole_answer_has_parsed_tool_calls() -> None:
    out = asyncio.run(Completion("m", True, body(), "hermes").whole([scripted(PIECES)]))
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure. "
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_without_tools_or_with_tool_choice_none_the_text_stays() -> None:
    for b in ({"messages": []}, body(tool_choice="none")):
        out = asyncio.run(Completion("m", True, b, "hermes").whole([scripted(PIECES)]))
        assert out["choices"][0]["message"]["content"] == "".join(PIECES)
        assert out["choices"][0]["finish_reason"] == "stop"


async def collect(completion: Completion, pieces: list[str]) -> list[Any]:
    events = []
    async for raw in completion.stream([scripted(pieces)]):
        for line in raw.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    return events


def test_stream_holds_the_call_back_and_sends_deltas() -> None:
    events = asyncio.run(collect(Completion("m", True, body(stream=True), "hermes"), PIECES))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    text = "".join(d.get("content", "") for d in deltas)
    assert text == "Sure. "  # nothing of the marker leaks as content
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"] == {"name": "weather", "arguments": ""}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Oslo"}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_stream_of_plain_text_that_looks_like_a_marker_start_is_not_lost() -> None:
    pieces = ["a <", "tool", " b"]
    events = asyncio.run(collect(Completion("m", True, body(stream=True), "hermes"), pieces))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("content", "") for d in deltas) == "a <tool b"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
