"""front/chat/request.py: each chat API's body becomes the one ChatCall the pipeline runs; an
equivalent request is the same call whichever API it came through."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from modelyard.front.api.native import NativeChatRequest, native_call
from modelyard.front.api.ollama import (
    ChatRequest,
    GenerateRequest,
    chat_call,
    generate_call,
    keep_alive_seconds,
)
from modelyard.front.api.openai import ChatCompletionRequest, CompletionRequest, openai_call
from modelyard.front.chat.request import CHAT_PATH, COMPLETION_PATH, ChatCall

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def _openai(data: dict[str, Any], path: str = CHAT_PATH) -> ChatCall:
    schema = ChatCompletionRequest if path == CHAT_PATH else CompletionRequest
    body = orjson.dumps(data)
    return openai_call(path, data, body, schema.model_validate(data))


def _ollama(data: dict[str, Any]) -> ChatCall:
    req = ChatRequest.model_validate(data)
    return chat_call(req, keep_alive_s=keep_alive_seconds(req.keep_alive))


def _generate(data: dict[str, Any]) -> ChatCall:
    req = GenerateRequest.model_validate(data)
    return generate_call(req, keep_alive_s=keep_alive_seconds(req.keep_alive))


def _native(data: dict[str, Any]) -> ChatCall:
    return native_call(NativeChatRequest.model_validate(data))


def _upstream(call: ChatCall) -> dict[str, Any]:
    """What reaches the backend, less the fields each API sets its own way: `stream_options`,
    and `session_id` (a turn's upstream body is made without it: front/chat/sessions/store.py)."""
    sent = orjson.loads(call.body) if call.body is not None else call.payload
    return {k: v for k, v in sent.items() if k not in ("stream_options", "session_id")}


@pytest.mark.parametrize("stream", [True, False])
def test_the_same_chat_is_the_same_call_from_every_api(stream: bool) -> None:
    openai = _openai({"model": "m", "messages": MESSAGES, "stream": stream,
                      "temperature": 0.5, "max_tokens": 7, "session_id": "s1"})
    ollama = _ollama({"model": "m", "messages": MESSAGES, "stream": stream,
                      "options": {"temperature": 0.5, "num_predict": 7}, "session_id": "s1"})
    native = _native({"model": "m", "messages": MESSAGES, "stream": stream,
                      "temperature": 0.5, "max_tokens": 7, "session_id": "s1"})
    for call in (openai, ollama, native):
        assert (call.model, call.path, call.stream, call.chat, call.progress) == (
            "m", CHAT_PATH, stream, True, True)
        assert call.archive is None and call.keep_alive_s is None
        assert call.own_fields["session_id"] == "s1"  # where the pipeline looks for a session
        assert _upstream(call) == {"model": "m", "messages": MESSAGES, "stream": stream,
                                   "temperature": 0.5, "max_tokens": 7}
    assert (openai.api, ollama.api, native.api) == ("openai", "ollama", "native")
    assert (openai.endpoint, ollama.endpoint, native.endpoint) == (
        "/v1/chat/completions", "/api/chat", "/chat")
    # The translated APIs read usage from the stream's last chunk, so they ask for it.
    for call in (ollama, native):
        assert ("stream_options" in call.payload) is stream


def test_openai_sends_the_clients_own_bytes_unless_modelyard_fields_must_come_out() -> None:
    data = {"model": "m", "messages": MESSAGES, "stream": True, "x_backend_flag": 1}
    body = orjson.dumps(data)
    call = openai_call(CHAT_PATH, data, body, ChatCompletionRequest.model_validate(data))
    assert call.body is body and call.payload is data  # the hot path: no copy, no re-encode

    asked = {**data, "archive": "1d"}
    call = openai_call(CHAT_PATH, asked, orjson.dumps(asked),
                       ChatCompletionRequest.model_validate(asked))
    assert call.body is None  # re-encoded without the field
    assert "archive" not in call.payload and call.payload["x_backend_flag"] == 1
    assert call.archive == "1d" and call.own_fields["archive"] == "1d"


def test_archive_field_is_read_and_never_sent_upstream_by_any_api() -> None:
    for call in (
        _openai({"model": "m", "messages": MESSAGES, "archive": True}),
        _ollama({"model": "m", "messages": MESSAGES, "archive": True}),
        _native({"model": "m", "messages": MESSAGES, "archive": True}),
        _generate({"model": "m", "prompt": "hi", "archive": True}),
    ):
        assert call.archive is True
        assert "archive" not in _upstream(call)


def test_prompt_style_requests_are_not_chats() -> None:
    text = _openai({"model": "m", "prompt": "once upon"}, path=COMPLETION_PATH)
    assert (text.path, text.chat, text.progress) == (COMPLETION_PATH, False, False)
    assert text.endpoint == "/v1/completions"
    raw = _generate({"model": "m", "prompt": "once upon", "raw": True, "stream": False})
    assert (raw.path, raw.chat, raw.progress, raw.stream) == (COMPLETION_PATH, False, True, False)
    assert raw.payload["prompt"] == "once upon"
    templated = _generate({"model": "m", "prompt": "hi", "system": "be brief"})
    assert (templated.path, templated.chat, templated.stream) == (CHAT_PATH, False, True)
    assert templated.payload["messages"] == MESSAGES


def test_ollama_keep_alive_and_options_reach_the_call() -> None:
    call = _ollama({"model": "m", "messages": MESSAGES, "keep_alive": "5m",
                    "options": {"top_k": 4, "num_ctx": 99}})
    assert call.keep_alive_s == 300.0
    assert call.payload["top_k"] == 4 and "num_ctx" not in call.payload
    assert call.stream is True  # Ollama streams unless told not to
