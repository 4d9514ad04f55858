"""Client-side tool calling (issue 8 part A) through a real `modelyard serve` and the fake
llama-server's deterministic tool-call mode: OpenAI and Ollama APIs, streamed and not, the tool
result sent back, and `tools_unsupported` for models that cannot call tools."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import pytest
from tests.integration.harness import config, module_server
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {
    "name": "time", "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
ASK = 'call weather {"city": "Oslo"} call time {}'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    models = [fake_model("tc"), {**fake_model("tc-off"), "tools": False},
              {"id": "svc", "backend": "service", "url": "http://127.0.0.1:9",
               "paths": {"chat": "/v1/chat/completions"}}]  # fmt: skip
    with module_server(tmp_path_factory, config(*models)) as s:
        yield s


def openai_chat(server: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)


def sse_json(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line.removeprefix("data: ")))
    return out


def test_openai_non_stream_tool_calls(server: Server) -> None:
    r = openai_chat(server, {"model": "tc", "tools": [WEATHER, TIME],
                             "messages": [{"role": "user", "content": ASK}]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Oslo"}), ("time", {})]


def test_openai_parallel_tool_calls_false_keeps_the_first(server: Server) -> None:
    r = openai_chat(server, {"model": "tc", "tools": [WEATHER, TIME],
                             "parallel_tool_calls": False,
                             "messages": [{"role": "user", "content": ASK}]})
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["weather"]


def test_openai_stream_tool_call_deltas(server: Server) -> None:
    r = openai_chat(server, {"model": "tc", "tools": [WEATHER], "stream": True,
                             "messages": [{"role": "user", "content": ASK}]})
    assert r.status_code == 200, r.text
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    finish = None
    for event in sse_json(r.text):
        for choice in event.get("choices") or []:
            for d in (choice.get("delta") or {}).get("tool_calls") or []:
                fn = d.get("function") or {}
                if fn.get("name"):
                    names[d["index"]] = fn["name"]
                args[d["index"]] = args.get(d["index"], "") + fn.get("arguments", "")
            finish = choice.get("finish_reason") or finish
    assert finish == "tool_calls"
    assert names == {0: "weather", 1: "time"}
    assert json.loads(args[0]) == {"city": "Oslo"} and json.loads(args[1]) == {}


def test_openai_tool_result_gets_the_final_answer(server: Server) -> None:
    first = openai_chat(server, {"model": "tc", "tools": [WEATHER], "messages": [
        {"role": "user", "content": 'call weather {"city": "Oslo"}'}]}).json()
    message = first["choices"][0]["message"]
    call = message["tool_calls"][0]
    r = openai_chat(server, {"model": "tc", "tools": [WEATHER], "messages": [
        {"role": "user", "content": 'call weather {"city": "Oslo"}'}, message,
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]})
    assert r.json()["choices"][0]["message"]["content"] == "tool said: sunny"


def test_ollama_client_tool_calls_and_result(server: Server) -> None:
    client = ollama.Client(host=server.url)
    messages: list[Any] = [{"role": "user", "content": ASK}]
    answer = client.chat("tc", messages=messages, tools=[WEATHER, TIME], stream=False)
    calls = answer.message.tool_calls or []
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("weather", {"city": "Oslo"}), ("time", {})]
    assert answer.done_reason == "stop"
    messages += [answer.message, {"role": "tool", "tool_name": "weather", "content": "rainy"}]
    final = client.chat("tc", messages=messages, tools=[WEATHER, TIME], stream=False)
    assert final.message.content == "tool said: rainy"


def test_ollama_stream_carries_complete_tool_calls_once(server: Server) -> None:
    client = ollama.Client(host=server.url)
    chunks = list(client.chat("tc", messages=[{"role": "user", "content": ASK}],
                              tools=[WEATHER, TIME], stream=True))
    with_calls = [c for c in chunks if c.message.tool_calls]
    assert len(with_calls) == 1
    calls = with_calls[0].message.tool_calls or []
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("weather", {"city": "Oslo"}), ("time", {})]
    assert chunks[-1].done and chunks[-1].done_reason == "stop"


@pytest.mark.parametrize("model", ["tc-off", "svc"])
def test_tools_unsupported(server: Server, model: str) -> None:
    r = openai_chat(server, {"model": model, "tools": [WEATHER],
                             "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "tools_unsupported" and err["param"] == "tools"
    r = httpx.post(server.url + "/api/chat", timeout=30, json={
        "model": model, "tools": [WEATHER], "stream": False,
        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "tools" in r.json()["error"]


def test_show_lists_tools_capability(server: Server) -> None:
    def caps(model: str) -> list[str]:
        r = httpx.post(server.url + "/api/show", json={"model": model}, timeout=30)
        assert r.status_code == 200, r.text
        return list(r.json()["capabilities"])

    assert "tools" in caps("tc") and "tools" not in caps("tc-off")


def test_native_chat_reports_tool_calls(server: Server) -> None:
    r = httpx.post(server.url + "/chat", timeout=30, json={
        "model": "tc", "tools": [WEATHER], "messages": [{"role": "user", "content": ASK}]})
    assert r.status_code == 200, r.text
    calls = r.json()["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Oslo"}), ("time", {})]
