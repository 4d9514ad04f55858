"""How Ollama's cut of a long prompt chooses what goes (front/chat/ollama_fit.py), from the
backend's counts: whole turns from the oldest, never a system message nor the last one."""

from __future__ import annotations

from typing import Any

import pytest

from modelyard.front.chat.ollama_fit import NUM_KEEP, answer_room, drop_turns, keep_end
from modelyard.front.chat.request import CHAT_PATH, COMPLETION_PATH, ChatCall

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def call(payload: dict[str, Any], path: str = CHAT_PATH) -> ChatCall:
    return ChatCall("ollama", "/api/chat", "m", path, False, payload)


def msg(role: str, text: str = "some words here", **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": text, **extra}


def test_the_oldest_turns_go_and_the_system_message_stays() -> None:
    messages = [msg("system"), *[msg(r) for r in ("user", "assistant") * 10], msg("user")]
    payload = {"messages": messages, "max_tokens": 10}
    out = drop_turns(call(payload), payload, n_prompt=220, n_ctx=100)
    assert out is not None
    kept = out["messages"]
    assert kept[0] == messages[0] and kept[-1] is messages[-1]
    assert kept[1]["role"] == "user" and kept[1:] == messages[len(messages) - len(kept) + 1:]
    assert 3 <= len(kept) < len(messages) and out["max_tokens"] == 10


def test_a_system_message_mid_chat_stays_too() -> None:
    messages = [msg("user"), msg("assistant"), msg("system", "mid"), *[msg("user")] * 6]
    payload = {"messages": messages}
    out = drop_turns(call(payload), payload, n_prompt=90, n_ctx=40)
    assert out is not None and msg("system", "mid") in out["messages"]
    assert msg("assistant") not in out["messages"]


def test_a_turn_never_begins_with_an_answer_or_a_tool_result() -> None:
    calls = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [msg("user"), msg("assistant", "", tool_calls=calls), msg("tool", "42"),
                msg("assistant"), msg("user"), msg("assistant"), msg("user")]
    payload = {"messages": messages}
    out = drop_turns(call(payload), payload, n_prompt=100, n_ctx=80)
    assert out is not None and out["messages"][0]["role"] == "user"
    assert not any(m["role"] == "tool" for m in out["messages"])


def test_when_the_estimate_says_it_fits_one_more_message_goes() -> None:
    messages = [msg("system"), msg("user"), msg("assistant"), msg("user")]
    payload = {"messages": messages}
    out = drop_turns(call(payload), payload, n_prompt=41, n_ctx=40)
    assert out is not None and out["messages"] == [messages[0], messages[-1]]


def test_the_system_and_last_messages_alone_cannot_be_cut() -> None:
    payload = {"messages": [msg("system"), msg("user")]}
    assert drop_turns(call(payload), payload, n_prompt=500, n_ctx=40) is None
    payload = {"messages": [msg("user")]}
    assert drop_turns(call(payload), payload, n_prompt=500, n_ctx=40) is None


def test_a_generate_prompt_keeps_its_end() -> None:
    text = "".join(chr(65 + n % 26) for n in range(1000))
    payload = {"prompt": text}
    out = keep_end(call(payload, COMPLETION_PATH), payload, n_prompt=1000, n_ctx=400)
    assert out is not None and text.endswith(out["prompt"])
    assert len(out["prompt"]) <= 300  # room for the answer: a quarter of the context


def test_token_ids_keep_their_first_tokens_and_their_end() -> None:
    ids = list(range(100))
    payload = {"prompt": ids, "n_predict": 5}
    c = call(payload, "/completion")
    c.context_prefix = ids
    out = keep_end(c, payload, n_prompt=100, n_ctx=50)
    assert out is not None
    assert out["prompt"] == [*ids[:NUM_KEEP], *ids[100 - (45 - NUM_KEEP):]]
    assert c.context_prefix == out["prompt"]


def test_the_room_left_for_the_answer() -> None:
    assert answer_room({}, 2048) == 512
    assert answer_room({"max_tokens": 100}, 2048) == 100
    assert answer_room({"max_tokens": -1}, 2048) == 512  # num_predict -1: no limit
    assert answer_room({"n_predict": 4000}, 2048) == 512
