"""Issue 32, item 9: the Anthropic answer names the stop sequence it stopped on
(`stop_reason: "stop_sequence"`, `stop_sequence`), whole and streamed, and its tool ids start
`toolu_`. On the backends' own JSON (llama-server's `__verbose`, its native completion, the
`stop_reason` vLLM and the transformers engine put in a choice): no server."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from tests.unit.test_anthropic_shapes import events

from modelyard.front.chat.render_anthropic import AnthropicRender, tool_use_id
from modelyard.front.chat.request import CHAT_PATH, ChatCall
from modelyard.front.chat.translate import Generation

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

CALL = ChatCall("anthropic", "/v1/messages", "m", CHAT_PATH, True, {})


def verbose(stop_type: str, word: str) -> dict[str, Any]:
    """llama-server's `__verbose` object (with `"verbose": true`), the fields read here."""
    return {"stop": True, "stop_type": stop_type, "stopping_word": word, "prompt": "…"}


def whole(payload: dict[str, Any]) -> dict[str, Any]:
    gen = Generation.start()
    gen.absorb(payload)
    return dict(orjson.loads(AnthropicRender().whole(CALL, gen).body))


def answer(text: str, **extra: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": text}}], **extra}


def test_llama_servers_stopping_word_is_the_stop_sequence() -> None:
    body = whole(answer("1, 2, ", __verbose=verbose("word", "3")))
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "3")


def test_the_end_of_the_turn_stays_end_turn() -> None:
    for payload in (answer("done", __verbose=verbose("eos", "")), answer("done")):
        body = whole(payload)
        assert (body["stop_reason"], body["stop_sequence"]) == ("end_turn", None)


def test_a_choices_stop_reason_names_it_as_vllm_and_the_transformers_engine_do() -> None:
    payload = answer("1, 2, ")
    payload["choices"][0]["stop_reason"] = "3"
    body = whole(payload)
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "3")
    payload["choices"][0]["stop_reason"] = 128009  # vLLM: a stop token id is not a sequence
    assert whole(payload)["stop_reason"] == "end_turn"


def test_the_native_completions_stopping_word() -> None:
    gen = Generation.start()
    gen.absorb({"content": "1, 2, ", **verbose("word", "3")})
    assert gen.finish_reason == "stop" and gen.stop_sequence == "3"


def test_the_streams_message_delta_names_it() -> None:
    render, gen = AnthropicRender(), Generation.start()
    raw = render.text(CALL, gen, gen.absorb({"choices": [{"index": 0, "delta": {
        "content": "1, 2, "}, "finish_reason": None}]}))  # fmt: skip
    # llama-server puts `__verbose` on the final chunk, the one with the finish reason.
    gen.absorb({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "__verbose": verbose("word", ", 3")})
    got = dict(events(raw + render.done(CALL, gen)))
    assert got["message_delta"]["delta"] == {"stop_reason": "stop_sequence",
                                             "stop_sequence": ", 3"}


def test_a_length_stop_or_a_tool_call_is_not_a_stop_sequence() -> None:
    gen = Generation.start()
    gen.absorb({"choices": [{"index": 0, "finish_reason": "length", "message": {
        "content": "1"}}], "__verbose": verbose("limit", "")})  # fmt: skip
    body = orjson.loads(AnthropicRender().whole(CALL, gen).body)
    assert (body["stop_reason"], body["stop_sequence"]) == ("max_tokens", None)


def test_tool_ids_start_toolu() -> None:
    assert tool_use_id("call_abc") == "toolu_abc"
    assert tool_use_id("Xq3vZ8pL2mN7") == "toolu_Xq3vZ8pL2mN7"  # llama-server's random ids
    assert tool_use_id("toolu_01A09q") == "toolu_01A09q"  # already Anthropic's: unchanged
    made = tool_use_id("")
    assert made.startswith("toolu_") and len(made) > len("toolu_")
    gen = Generation.start()
    gen.absorb({"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "content": None, "tool_calls": [{"id": "k2Jf9", "type": "function", "function": {
            "name": "w", "arguments": "{}"}}]}}]})  # fmt: skip
    body = orjson.loads(AnthropicRender().whole(CALL, gen).body)
    assert body["content"] == [{"type": "tool_use", "id": "toolu_k2Jf9", "name": "w",
                                "input": {}}]
