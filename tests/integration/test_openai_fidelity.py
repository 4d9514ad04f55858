"""OpenAI fidelity where llama-server's OpenAI API differs (issue 18 item 2,
front/chat/openai_compat.py), through a real `modelyard serve` and the fake llama-server:
a named `tool_choice`, `stream_options.include_usage`, completions `echo`, integer `logprobs`
and `suffix`, and a context overflow as `context_length_exceeded` (OpenAI and Ollama shapes)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from tests.integration.harness import config, model_status, module_server
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

WEATHER = {"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
TIME = {"type": "function", "function": {
    "name": "time", "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
USER = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    models = [fake_model("m", "--no-fim"), fake_model("small", "--ctx-size", "8")]
    with module_server(tmp_path_factory, config(*models)) as s:
        yield s


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def sse_json(text: str) -> list[dict[str, Any]]:
    return [json.loads(line.removeprefix("data: ")) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip


def last_received(server: Server, model: str) -> dict[str, Any]:
    """What the model's fake backend was last sent (its /requests route)."""
    found = model_status(server, model)
    assert found is not None and found["upstream"]
    return dict(httpx.get(found["upstream"] + "/requests", timeout=10).json()[-1])


# ---- tool_choice ---------------------------------------------------------------------------------


def test_a_named_tool_choice_reaches_the_backend_as_required_with_that_tool_only(
        server: Server) -> None:  # fmt: skip
    choice = {"type": "function", "function": {"name": "time"}}
    r = post(server, "/v1/chat/completions", {
        "model": "m", "messages": USER, "tools": [WEATHER, TIME], "tool_choice": choice})
    assert r.status_code == 200, r.text
    sent = last_received(server, "m")
    assert sent["tool_choice"] == "required"  # llama-server reads strings only
    assert [t["function"]["name"] for t in sent["tools"]] == ["time"]


def test_a_tool_choice_naming_an_unknown_function_is_a_400(server: Server) -> None:
    choice = {"type": "function", "function": {"name": "nope"}}
    r = post(server, "/v1/chat/completions", {
        "model": "m", "messages": USER, "tools": [WEATHER], "tool_choice": choice})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tool_choice" and "nope" in r.json()["error"]["message"]


def test_a_string_tool_choice_is_passed_through_unchanged(server: Server) -> None:
    raw = json.dumps({"model": "m", "messages": USER, "tools": [WEATHER],
                      "tool_choice": "required"}, indent=1)  # bytes no re-encoding would keep
    r = httpx.post(server.url + "/v1/chat/completions", content=raw, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert last_received(server, "m") == json.loads(raw)


# ---- include_usage -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_include_usage_gives_null_usage_then_a_last_usage_chunk(server: Server, path: str) -> None:
    body: dict[str, Any] = {"model": "m", "max_tokens": 3, "stream": True,
                            "stream_options": {"include_usage": True}}
    body.update({"messages": USER} if "chat" in path else {"prompt": "hello there"})
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    events = sse_json(r.text)
    *others, last = events
    assert others and all("usage" in e and e["usage"] is None for e in others), others
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    assert r.text.rstrip().endswith("data: [DONE]")


def test_the_openai_sdk_reads_include_usage_chunks(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=30)
    chunks = list(client.completions.create(
        model="m", prompt="hi", max_tokens=2, stream=True,
        stream_options={"include_usage": True}))
    assert [c.usage is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert chunks[-1].choices == []  # the usage on a chunk of its own, as OpenAI sends it
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "The quick"


# ---- completions: echo, logprobs, suffix ---------------------------------------------------------


def test_echo_prepends_the_prompt(server: Server) -> None:
    r = post(server, "/v1/completions",
             {"model": "m", "prompt": "Once upon", "max_tokens": 2, "echo": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Once uponThe quick"
    streamed = post(server, "/v1/completions", {"model": "m", "prompt": "Once upon",
                                                "max_tokens": 2, "echo": True, "stream": True})
    text = "".join(c["text"] for e in sse_json(streamed.text) for c in e["choices"])
    assert text == "Once uponThe quick"


def test_integer_logprobs_come_in_the_completions_shape(server: Server) -> None:
    r = post(server, "/v1/completions",
             {"model": "m", "prompt": "hi", "max_tokens": 3, "logprobs": 2})
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    assert logprobs == {
        "tokens": ["The", " quick", " brown"],
        "token_logprobs": [0.0, -0.1, -0.2],
        "top_logprobs": [{"The": 0.0, " quick": -0.1}, {" quick": -0.1, " brown": -0.2},
                         {" brown": -0.2, " fox": -0.3}],
        "text_offset": [0, 3, 9],
    }


def test_echo_with_logprobs_reaches_an_openai_server_as_sent(server: Server) -> None:
    """`echo` with an integer `logprobs` asks for the prompt's log probabilities (issue 32): on a
    llama.cpp model the front scores it (front/chat/scoring.py); an `openai` backend gets the
    request as sent, since such a server (vLLM) scores prompts itself and the front cannot."""
    sent = {"model": "m", "prompt": "hi", "max_tokens": 2, "logprobs": 1, "echo": True}
    r = post(server, "/v1/completions", sent)
    assert r.status_code == 200, r.text
    received = last_received(server, "m")
    assert (received["echo"], received["logprobs"], received["prompt"]) == (True, 1, "hi")


def test_the_openai_sdk_reads_completion_logprobs(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=30)
    done = client.completions.create(model="m", prompt="hi", max_tokens=2, logprobs=1)
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens == ["The", " quick"]


def test_suffix_on_a_model_without_fim_is_a_400(server: Server) -> None:
    r = post(server, "/v1/completions",
             {"model": "m", "prompt": "def f(", "suffix": "):\n", "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "suffix_unsupported"
    assert last_received(server, "m").get("suffix") is None  # /infill was asked, not completions


# ---- context overflow ----------------------------------------------------------------------------


LONG = "one two three four five six seven eight nine ten"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_context_overflow_is_context_length_exceeded(server: Server, path: str) -> None:
    body: dict[str, Any] = {"model": "small", "max_tokens": 2}
    body.update({"messages": [{"role": "user", "content": LONG}]} if "chat" in path
                else {"prompt": LONG})
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert err["type"] == "invalid_request_error"
    assert err["message"].startswith(
        "This model's maximum context length is 8 tokens. However, your messages resulted in "
        "10 tokens.")


def test_the_openai_sdk_sees_a_bad_request_not_a_retry(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=30, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="small",
                                       messages=[{"role": "user", "content": LONG}])
    assert info.value.code == "context_length_exceeded"


def test_ollama_context_overflow_has_its_shape(server: Server) -> None:
    r = post(server, "/api/chat", {"model": "small", "stream": False,
                                   "messages": [{"role": "user", "content": LONG}]})
    assert r.status_code == 400, r.text
    assert r.json() == {"error": "This model's maximum context length is 8 tokens. However, "
                                 "your messages resulted in 10 tokens. Please reduce the "
                                 "length of the messages. (context_length_exceeded)"}
