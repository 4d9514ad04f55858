"""front/chat/openai_compat.py: what a request needs beyond the passthrough, and the reshaping
of llama-server's answers (SSE split anywhere, as the network delivers it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from tests.e2e.compat.table import covers

from modelyard.errors import InvalidRequest
from modelyard.front.chat.openai_compat import Reshape, prepare

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def test_requests_that_ask_for_nothing_keep_the_passthrough() -> None:
    assert prepare(CHAT, {"model": "m", "messages": [], "tool_choice": "required",
                          "stream": True}, chat=True) is None
    assert prepare(COMPLETIONS, {"model": "m", "prompt": "x", "logprobs": None,
                                 "echo": False, "suffix": ""}, chat=False) is None
    assert prepare(COMPLETIONS, {"model": "m", "prompt": "x"}, chat=False) is None


def test_a_named_tool_choice_needs_a_function_it_names() -> None:
    with pytest.raises(InvalidRequest):
        prepare(CHAT, {"tool_choice": {"type": "function"}, "tools": []}, chat=True)
    with pytest.raises(InvalidRequest):
        prepare(CHAT, {"tool_choice": {"type": "function", "function": {"name": "a"}}},
                chat=True)


def test_echo_of_token_ids_is_refused() -> None:
    with pytest.raises(InvalidRequest) as info:
        prepare(COMPLETIONS, {"prompt": [1, 2], "echo": True}, chat=False)
    assert info.value.param == "echo"


def test_suffix_goes_to_infill() -> None:
    prepared = prepare(COMPLETIONS, {"model": "m", "prompt": "a", "suffix": "b",
                                     "max_tokens": 3, "temperature": 0}, chat=False)
    assert prepared is not None and prepared.path == "/infill"
    assert prepared.payload == {"input_prefix": "a", "input_suffix": "b", "prompt": "",
                                "n_predict": 3, "temperature": 0}


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


def _events(data: bytes) -> list[Any]:
    return [orjson.loads(line[6:]) for line in data.split(b"\n")
            if line.startswith(b"data: {")]


@pytest.mark.parametrize("size", [1, 7, 10_000])
def test_include_usage_survives_any_chunking(size: int) -> None:
    upstream = (b'data: {"choices":[{"text":"a","index":0}]}\n\n'
                b'data: {"choices":[{"text":"","index":0,"finish_reason":"length"}],'
                b'"usage":{"completion_tokens":1}}\n\ndata: [DONE]\n\n')

    async def run() -> bytes:
        reshape = Reshape(model="m", include_usage=True, echo=["P"])
        return b"".join([c async for c in reshape.stream(_chunks(upstream, size))])

    out = asyncio.run(run())
    events = _events(out)
    assert [e["usage"] for e in events] == [None, None, {"completion_tokens": 1}]
    assert events[0]["choices"][0]["text"] == "Pa" and events[2]["choices"] == []
    assert out.endswith(b"data: [DONE]\n\n")


@covers("Fill in the middle (suffix)", "OpenAI")
def test_infill_answers_become_text_completions() -> None:
    whole = Reshape(model="m", infill=True).whole(orjson.dumps(
        {"content": "mid", "stop": True, "stop_type": "limit", "tokens_predicted": 2,
         "tokens_evaluated": 5}))
    body = orjson.loads(whole)
    assert body["object"] == "text_completion" and body["model"] == "m"
    assert body["choices"][0]["text"] == "mid" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
