"""The official `ollama` SDK, unchanged, against modelyard on its embedded defaults."""

from __future__ import annotations

import datetime as dt

import httpx
import ollama
import pytest
from tests.e2e.compat.table import covers
from tests.support import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PROMPT = [{"role": "user", "content": "Name one colour of the rainbow."}]
# Greedy wherever an assertion reads what the demo model wrote: sampled, it may end at once.
GREEDY = {"temperature": 0, "seed": 7}


@pytest.fixture(scope="module")
def client(compat_server: Server) -> ollama.Client:
    return ollama.Client(host=compat_server.url, timeout=120)


@covers("Model names with and without `:latest`", "Ollama")
@covers("Model listing and details", "Ollama")
def test_tags_show_tagged_names(client: ollama.Client) -> None:
    names = [m.model for m in client.list().models]
    assert "smollm2:latest" in names and "all-minilm:latest" in names
    shown = client.show("smollm2")
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert "vision" not in shown.capabilities and "embedding" not in shown.capabilities
    assert client.show("all-minilm:latest").capabilities == ["embedding"]


@covers("Chat: system prompt, multi-turn", "Ollama")
@covers("Streaming", "Ollama")
@covers("Token usage (all prompt tokens)", "Ollama")
def test_chat_stream_and_true_prompt_count(client: ollama.Client) -> None:
    messages = [{"role": "system", "content": "Answer in one word."}, *PROMPT]
    parts = list(client.chat(model="smollm2:latest", messages=messages, stream=True,
                             options={"num_predict": 8, **GREEDY}))
    assert "".join(p.message.content or "" for p in parts).strip()
    first = parts[-1]
    assert first.done and (first.prompt_eval_count or 0) > 10
    # The same request again hits llama-server's prompt cache; Ollama still counts every token.
    again = client.chat(model="smollm2", messages=messages, options={"num_predict": 8})
    assert again.prompt_eval_count == first.prompt_eval_count


@covers("Seed, stop sequences, temperature", "Ollama")
def test_seed_and_stop(client: ollama.Client) -> None:
    def ask() -> str:
        return client.chat(model="smollm2", messages=PROMPT,
                           options={"seed": 7, "temperature": 1.0, "num_predict": 16}
                           ).message.content or ""

    assert ask() == ask()
    stopped = client.generate(model="smollm2", prompt="Count: 1, 2, 3, 4, 5. Repeat the count.",
                              options={"stop": ["3"], "temperature": 0, "num_predict": 32})
    assert "3" not in stopped.response


@covers("Text completion", "Ollama")
def test_generate_raw_and_template(client: ollama.Client) -> None:
    first = client.generate(model="smollm2", prompt="Say one word.",
                            options={"num_predict": 6, **GREEDY})
    assert first.response and first.done
    raw = client.generate(model="smollm2", prompt="1, 2, 3,", raw=True,
                          options={"num_predict": 4, **GREEDY})
    assert raw.response
    templated = client.generate(model="smollm2", prompt="1, 2, 3,",
                                template="{{ .Prompt }}", options={"num_predict": 4, **GREEDY})
    assert templated.response == raw.response


@covers("Context size per request (num_ctx)", "Ollama")
@pytest.mark.timeout(420)
def test_num_ctx_gets_a_larger_context(compat_server: Server) -> None:
    # It starts a second llama-server and prefills 3,000 tokens on it: on a loaded 2-core machine
    # that took longer than the shared client's 120 s, so this client waits longer.
    client = ollama.Client(host=compat_server.url, timeout=360)
    long = "word " * 3000  # over the 2048-token default context
    cut = client.generate(model="smollm2", prompt=long, options={"num_predict": 2})
    assert (cut.prompt_eval_count or 0) <= 2048  # as Ollama: the prompt's end, in the context
    answer = client.generate(model="smollm2", prompt=long,
                             options={"num_predict": 2, "num_ctx": 4096})
    assert (answer.prompt_eval_count or 0) > 2048


@covers("Thinking", "Ollama")
def test_think_on_a_model_without_thinking_is_a_400(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="smollm2", messages=PROMPT, think=True)
    assert err.value.status_code == 400 and "thinking" in err.value.error


@covers("Embeddings", "Ollama")
def test_embed(client: ollama.Client) -> None:
    out = client.embed(model="all-minilm", input=["a cat", "a dog"])
    assert len(out.embeddings) == 2 and len(out.embeddings[0]) == 384


@covers("Model management (copy, create, delete, push)", "Ollama")
def test_copy_create_delete(compat_server: Server, client: ollama.Client) -> None:
    # Making and deleting models is an admin's (a loopback client needs a token for it).
    admin = ollama.Client(host=compat_server.url, timeout=120,
                          headers=compat_server.admin_headers)
    admin.copy("smollm2", "my-copy")
    admin.create(model="pirate", from_="smollm2", system="You are a pirate.",
                  parameters={"temperature": 0.1})
    assert client.chat(model="pirate", messages=PROMPT, options={"num_predict": 4}).message
    admin.delete("my-copy")
    admin.delete("pirate")
    names = [m.model for m in client.list().models]
    assert "smollm2:latest" in names and "my-copy:latest" not in names
    with pytest.raises(ollama.ResponseError) as err:
        admin.push("smollm2")
    assert err.value.status_code == 501


@covers("Loaded models (ps) and keep_alive", "Ollama")
def test_ps_as_clients_read_it(client: ollama.Client) -> None:
    client.generate(model="smollm2", prompt="Hi", keep_alive=-1, options={"num_predict": 1})
    running = {m.model: m for m in client.ps().models}
    demo = running["smollm2:latest"]
    assert demo.size and demo.size_vram is not None and demo.size_vram <= demo.size
    assert demo.size_vram == 0  # a CPU-only machine: nothing on a GPU
    assert demo.expires_at is not None and demo.expires_at.year > dt.datetime.now().year + 10
    assert demo.context_length and demo.context_length >= 2048


@covers("Errors in the API's own shape", "Ollama")
@covers("`Ollama is running`, CORS for local pages", "Ollama")
def test_server_identity_cors_and_errors(compat_server: Server, client: ollama.Client) -> None:
    assert httpx.head(compat_server.url + "/").status_code == 200
    root = httpx.get(compat_server.url + "/", headers={"Accept": "*/*"})
    assert root.text == "Ollama is running"
    pre = httpx.options(compat_server.url + "/api/chat", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
    assert pre.status_code in (200, 204)
    assert pre.headers["access-control-allow-origin"] == "http://localhost:3000"
    evil = httpx.options(compat_server.url + "/api/chat", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in evil.headers
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="no-such-model", messages=PROMPT)
    assert err.value.status_code == 404


@covers("Tools: calls and results round trip", "Ollama")
def test_tool_result_round_trip(client: ollama.Client) -> None:
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "Sunny, 21 C"},
    ]
    answer = client.chat(model="smollm2", messages=messages, tools=[weather],
                         options={"num_predict": 20, **GREEDY})
    assert answer.done and (answer.message.content or answer.message.tool_calls)
