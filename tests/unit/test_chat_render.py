"""front/chat/render.py: each chat API frames the pipeline's answer in its own shapes (OpenAI
SSE, Ollama NDJSON/JSON, native SSE/JSON), its errors too (DESIGN.md §3.8)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from modelyard.errors import InvalidRequest
from modelyard.front.chat import render
from modelyard.front.chat.request import CHAT_PATH, ChatCall
from modelyard.front.chat.translate import Generation
from modelyard.front.sse import read_event

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def _call(api: Any = "ollama") -> ChatCall:
    return ChatCall(api, "/x", "alias", CHAT_PATH, True, {"model": "alias", "messages": []})


def _gen(*chunks: dict[str, Any]) -> Generation:
    gen = Generation.start()
    for chunk in chunks:
        gen.absorb(chunk)
    return gen


def _lines(raw: bytes) -> list[dict[str, Any]]:
    assert raw.endswith(b"\n")
    return [orjson.loads(line) for line in raw.splitlines()]


def _sse(raw: bytes) -> dict[str, Any]:
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    event = read_event(raw.strip())
    assert isinstance(event, dict)
    return event


TEXT = {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}
END = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
       "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
CALL = {"choices": [{"index": 0, "delta": {"tool_calls": [
    {"index": 0, "id": "c1", "function": {"name": "add", "arguments": "{\"a\": 2}"}}]}}]}


def test_ollama_chat_streams_messages_then_a_closing_one_with_statistics() -> None:
    call, gen = _call(), _gen(TEXT, END)
    [chunk] = _lines(render.OLLAMA_CHAT.text(call, gen, "Hi"))
    assert chunk["model"] == "alias" and chunk["done"] is False
    assert chunk["message"] == {"role": "assistant", "content": "Hi"}
    [last] = _lines(render.OLLAMA_CHAT.done(call, gen))
    assert last["done"] is True and last["done_reason"] == "length"
    assert last["message"]["content"] == "" and last["eval_count"] == 1
    assert last["prompt_eval_count"] == 5 and "total_duration" in last
    whole = orjson.loads(render.OLLAMA_CHAT.whole(call, gen).body)
    assert whole["message"]["content"] == "Hi" and whole["done"] is True


def test_ollama_chat_sends_complete_tool_calls_in_their_own_chunk_before_the_end() -> None:
    call, gen = _call(), _gen(CALL, END)
    calls, last = _lines(render.OLLAMA_CHAT.done(call, gen))
    assert calls["done"] is False
    assert calls["message"]["tool_calls"] == [{"function": {"name": "add",
                                                            "arguments": {"a": 2}}}]
    assert last["done"] is True and "tool_calls" not in last["message"]
    assert gen.tool_calls  # the answer keeps its calls (a session or archive reads them after)
    whole = orjson.loads(render.OLLAMA_CHAT.whole(call, gen).body)
    assert whole["message"]["tool_calls"][0]["function"]["name"] == "add"


def test_ollama_generate_frames_response_text_and_progress_as_thinking() -> None:
    call, gen = _call(), _gen(TEXT, END)
    [chunk] = _lines(render.OLLAMA_GENERATE.text(call, gen, "Hi"))
    assert chunk["response"] == "Hi" and "message" not in chunk
    [progress] = _lines(render.OLLAMA_GENERATE.progress(call, gen, "loading alias"))
    assert progress["thinking"] == "loading alias\n" and progress["done"] is False
    [progress] = _lines(render.OLLAMA_CHAT.progress(call, gen, "loading alias"))
    assert progress["message"]["thinking"] == "loading alias\n"
    whole = orjson.loads(render.OLLAMA_GENERATE.whole(call, gen).body)
    assert whole["response"] == "Hi" and whole["done_reason"] == "length"


def test_native_streams_deltas_then_a_final_event_and_answers_whole_with_the_message() -> None:
    call, gen = _call("native"), _gen(CALL, TEXT, END)
    assert _sse(render.NATIVE.text(call, gen, "Hi")) == {"delta": {"content": "Hi"},
                                                         "done": False}
    final = _sse(render.NATIVE.done(call, gen))
    assert final["delta"] == {} and final["done"] is True and "message" not in final
    assert final["tool_calls"][0]["function"] == {"name": "add", "arguments": "{\"a\": 2}"}
    whole = orjson.loads(render.NATIVE.whole(call, gen).body)
    assert whole["message"] == {"role": "assistant", "content": "Hi"}
    progress = _sse(render.NATIVE.progress(call, gen, "loading"))
    assert progress == {"delta": {"reasoning_content": "loading\n"}, "done": False}


def test_openai_progress_is_a_chat_chunk_carrying_reasoning() -> None:
    chunk = _sse(render.OPENAI.progress(_call("openai"), None, "unloading b"))
    assert chunk["object"] == "chat.completion.chunk" and chunk["model"] == "alias"
    assert chunk["choices"][0]["delta"]["reasoning_content"] == "unloading b\n"
    assert chunk["choices"][0]["finish_reason"] is None


def test_in_band_errors_take_each_apis_error_shape() -> None:
    exc = InvalidRequest("bad thing", param="x")
    assert _sse(render.OPENAI.error_event(exc))["error"]["param"] == "x"
    assert _lines(render.OLLAMA_CHAT.error_event(exc)) == [{"error": "bad thing"}]
    native = _sse(render.NATIVE.error_event(exc))
    assert native["message"] == "bad thing" and native["error"] == exc.code


UPSTREAM = orjson.dumps({"error": {"message": "context too long", "code": 400}})


def test_upstream_errors_keep_their_status_in_each_apis_shape() -> None:
    call = _call()
    passed = render.OPENAI.upstream_error(call, 400, "application/json; x=1", UPSTREAM)
    assert (passed.status_code, passed.body) == (400, UPSTREAM)  # unchanged
    assert passed.media_type == "application/json; x=1"
    ollama = render.OLLAMA_CHAT.upstream_error(call, 400, "application/json", UPSTREAM)
    assert ollama.status_code == 400
    assert orjson.loads(ollama.body) == {"error": "context too long"}
    native = render.NATIVE.upstream_error(call, 503, "application/json", UPSTREAM)
    body = orjson.loads(native.body)
    assert native.status_code == 503 and body["error"] == "upstream_error"
    assert body["message"] == "context too long" and body["consumer"] == "alias"
