"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) driven by the official
`anthropic` SDK, unchanged, against a real `modelyard serve` (auth `required`: the SDK's
`x-api-key` is the credential) and fake llama-server processes: whole and streamed answers in
Anthropic's event order, system prompts, tool use round trips, image blocks, token counts and
every error in Anthropic's shape."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from tests.e2e.compat.table import covers
from tests.integration.harness import TEXT_3, config, model_status, module_server
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

HELLO: list[Any] = [{"role": "user", "content": "Say hello to me"}]  # 4 words for the fake
WEATHER = {"name": "weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}  # fmt: skip
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}
# A 1x1 PNG.
PNG = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c4890000000d49444154789c63"
    "f8cfc0f01f0005000201e22bd3a70000000049454e44ae426082")).decode()  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    models = [fake_model("m"), fake_model("vis", "--mmproj", "proj.gguf"),
              fake_model("crashy", "--crash-after-tokens", "2"),
              fake_model("q", "--tokens-per-s", "20", max_concurrency=1, max_queue=0)]
    with module_server(tmp_path_factory, config(*models, auth="required"),
                       "--single-process") as s:
        yield s


def key(server: Server) -> str:
    return (server.home / "cli-token").read_text().strip()


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key(server), max_retries=0,
                               timeout=60)


def sent_to_backend(server: Server, model: str) -> dict[str, Any]:
    found = model_status(server, model)
    assert found is not None and found["upstream"]
    return dict(httpx.get(found["upstream"] + "/requests", timeout=10).json()[-1])


def raw_post(server: Server, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60,
                      headers={"x-api-key": key(server), **headers})


def sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each event of an Anthropic stream."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_whole_message_with_system_prompt(client: anthropic.Anthropic, server: Server) -> None:
    message = client.messages.create(model="m", max_tokens=3, system="Be brief",
                                     messages=HELLO, stop_sequences=["END"],
                                     metadata={"user_id": "u1"},
                                     output_config={"format": {"type": "json_schema",
                                                               "schema": SCHEMA}},
                                     # (this SDK has no sampling arguments: sent as extras)
                                     extra_body={"temperature": 0.5, "top_k": 7})
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == "m"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == TEXT_3
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (6, 3)
    sent = sent_to_backend(server, "m")
    assert sent["messages"] == [{"role": "system", "content": "Be brief"}, *HELLO]
    assert (sent["max_tokens"], sent["temperature"], sent["top_k"]) == (3, 0.5, 7)
    assert sent["stop"] == ["END"] and "metadata" not in sent
    assert sent["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": SCHEMA}}


def test_stream_events_in_anthropics_order(server: Server) -> None:
    r = raw_post(server, "/v1/messages", {"model": "m", "max_tokens": 3, "stream": True,
                                          "messages": HELLO}, **{"anthropic-version": "2023-06-01"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert all(name == data["type"] for name, data in events)  # `event:` named like the type
    names = [name for name, _ in events]
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * 3,
                     "content_block_stop", "message_delta", "message_stop"]
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == TEXT_3
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": 4, "cache_read_input_tokens": 0,
                              "cache_creation_input_tokens": 0, "output_tokens": 3}


def test_sdk_stream_builds_the_message(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model="m", max_tokens=3, messages=HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == TEXT_3
    assert final.content[0].text == TEXT_3
    assert final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (4, 3)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip(client: anthropic.Anthropic, server: Server, stream: bool) -> None:
    ask: list[Any] = [{"role": "user", "content": 'call weather {"city": "Oslo"}'}]
    if stream:
        with client.messages.stream(model="m", max_tokens=50, tools=[WEATHER],
                                    messages=ask) as s:
            first = s.get_final_message()
    else:
        first = client.messages.create(model="m", max_tokens=50, tools=[WEATHER],
                                       messages=ask)
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("weather", {"city": "Oslo"})]
    sent = sent_to_backend(server, "m")
    assert sent["tools"] == [{"type": "function", "function": {
        "name": "weather", "description": "Weather in a city",
        "parameters": WEATHER["input_schema"]}}]  # fmt: skip
    result = {"type": "tool_result", "tool_use_id": uses[0].id,
              "content": [{"type": "text", "text": "sunny"}]}
    final = client.messages.create(
        model="m", max_tokens=50, tools=[WEATHER],
        messages=[*ask, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [result]}])
    assert final.content[0].text == "tool said: sunny"
    assert final.stop_reason == "end_turn"
    sent = sent_to_backend(server, "m")
    assert sent["messages"][1]["tool_calls"][0]["id"] == uses[0].id
    assert json.loads(sent["messages"][1]["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Oslo"}
    assert sent["messages"][2] == {"role": "tool", "tool_call_id": uses[0].id,
                                   "content": "sunny"}


def test_tool_error_result_and_tool_choice(client: anthropic.Anthropic, server: Server) -> None:
    ask: list[Any] = [{"role": "user", "content": "what is the weather?"}]
    first = client.messages.create(model="m", max_tokens=50, tools=[WEATHER],
                                   tool_choice={"type": "any"}, messages=ask)
    assert sent_to_backend(server, "m")["tool_choice"] == "required"
    use = next(b for b in first.content if b.type == "tool_use")
    final = client.messages.create(
        model="m", max_tokens=50, tools=[WEATHER],
        tool_choice={"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
        messages=[*ask, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "boom", "is_error": True}]}])
    assert final.content[0].text == "tool said: Error: boom"
    sent = sent_to_backend(server, "m")
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert sent["parallel_tool_calls"] is False


@covers("Images (vision)", "Anthropic")
def test_image_block_reaches_the_backend(client: anthropic.Anthropic, server: Server) -> None:
    message = client.messages.create(model="vis", max_tokens=3, messages=[{
        "role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG}},
            {"type": "text", "text": "What is this?"}]}])  # fmt: skip
    assert message.content[0].text == TEXT_3
    content = sent_to_backend(server, "vis")["messages"][0]["content"]
    assert content == [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                       {"type": "text", "text": "What is this?"}]


def test_count_tokens_is_the_models_own_count(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model="m", system="Be brief", messages=HELLO)
    answered = client.messages.create(model="m", max_tokens=3, system="Be brief",
                                      messages=HELLO)
    assert counted.input_tokens == answered.usage.input_tokens == 6


def test_errors_in_anthropics_shape(client: anthropic.Anthropic, server: Server) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="nope", max_tokens=3, messages=HELLO)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=HELLO)
    r = raw_post(server, "/v1/messages", {"model": "m", "messages": HELLO})  # no max_tokens
    assert r.status_code == 400
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    thinking = {"type": "enabled", "budget_tokens": 100}
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        client.messages.create(model="m", max_tokens=3, messages=HELLO,
                               thinking=thinking)
    bad_image = [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "@@@"}}]}]
    with pytest.raises(anthropic.BadRequestError, match="base64"):
        client.messages.create(model="vis", max_tokens=3, messages=bad_image)


@covers("Auth with a modelyard token", "Anthropic")
def test_auth_by_x_api_key(server: Server) -> None:
    wrong = anthropic.Anthropic(base_url=server.url, api_key="my-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model="m", max_tokens=3, messages=HELLO)
    assert refused.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/messages/count_tokens", timeout=30,
                   json={"model": "m", "messages": HELLO})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # The same key as a bearer token, for the other APIs.
    ok = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                    headers={"x-api-key": key(server)},
                    json={"model": "m", "max_tokens": 3, "messages": HELLO})
    assert ok.status_code == 200, ok.text


def test_upstream_error_before_and_after_the_first_byte(client: anthropic.Anthropic,
                                                        server: Server) -> None:
    # An image for a model loaded without its projector: llama-server's 500, in our shape.
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG}}
    with pytest.raises(anthropic.InternalServerError) as failed:
        client.messages.create(model="m", max_tokens=3,
                               messages=[{"role": "user", "content": [image]}])
    assert failed.value.body["error"]["type"] == "api_error"
    assert "image input is not supported" in failed.value.body["error"]["message"]
    # A backend that crashes mid-stream: an `error` event ends the stream.
    r = raw_post(server, "/v1/messages", {"model": "crashy", "max_tokens": 5, "stream": True,
                                          "messages": HELLO})
    events = sse(r.text)
    assert events[0][0] == "message_start"
    name, data = events[-1]
    assert name == "error" and data["type"] == "error"
    assert data["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIStatusError), client.messages.stream(
            model="crashy", max_tokens=5, messages=HELLO) as stream:
        stream.get_final_message()


def test_queue_full_is_a_rate_limit_error(client: anthropic.Anthropic, server: Server) -> None:
    body = {"model": "q", "max_tokens": 40, "stream": True, "messages": HELLO}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60,
                      headers={"x-api-key": key(server)}) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("event: content_block_delta"))
        with pytest.raises(anthropic.RateLimitError) as refused:
            client.messages.create(model="q", max_tokens=3, messages=HELLO)
        for _ in lines:
            pass
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    assert refused.value.response.headers.get("retry-after")


def test_server_side_session_carries_the_history(server: Server) -> None:
    headers = {"x-api-key": key(server), "X-Session-Id": "anth-s1"}
    first = httpx.post(server.url + "/v1/messages", headers=headers, timeout=60, json={
        "model": "m", "max_tokens": 3, "messages": HELLO})  # fmt: skip
    assert first.status_code == 200, first.text
    again = [{"role": "user", "content": "And again"}]
    second = httpx.post(server.url + "/v1/messages", headers=headers, timeout=60, json={
        "model": "m", "max_tokens": 3, "stream": True, "messages": again})  # fmt: skip
    assert second.status_code == 200 and sse(second.text)[-1][0] == "message_stop"
    sent = sent_to_backend(server, "m")["messages"]
    assert sent == [*HELLO, {"role": "assistant", "content": TEXT_3}, *again]
