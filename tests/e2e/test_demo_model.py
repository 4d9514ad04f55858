"""End to end: the real llama-server with the real demo model, through modelyard's front and
engine processes, driven by the official `openai` and `ollama` clients and raw HTTP.

One modelyard server (so one llama-server) is shared by the whole module.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import openai
import pytest
from tests.support import ROOT, Server, backend_headers, poll, require_e2e_artifact

from modelyard.config import DEMO_MODEL_FILE, Settings, cache_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PROMPT = [{"role": "user", "content": "Name one colour of the rainbow."}]
# Greedy wherever an assertion reads what the demo model wrote: sampled, it may end at once.
GREEDY: dict[str, Any] = {"temperature": 0, "seed": 7}
MCP_SERVER = ROOT / "tests" / "fakes" / "mcp_server.py"  # add, boom, hang over stdio


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_e2e_artifact(Settings().resolve_llama_server(), "llama-server")
    gguf = require_e2e_artifact(cache_dir() / "models" / DEMO_MODEL_FILE, "the demo model")
    home = tmp_path_factory.mktemp("e2e-home")
    (home / "models").mkdir()
    (home / "models" / DEMO_MODEL_FILE).symlink_to(gguf)
    # No config models: the demo model must be found and named `smollm2` by itself.
    mcp = {"id": "calc", "command": [sys.executable, str(MCP_SERVER)], "tool_timeout_s": 10}
    srv = Server(home, {"scan_hf_cache": False, "default_ctx_size": 2048, "mcp_servers": [mcp]})
    try:
        srv.wait_healthy(90)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)


def test_models_lists_the_demo_model(server: Server, oai: openai.OpenAI) -> None:
    assert "smollm2" in [m.id for m in oai.models.list().data]
    native = httpx.get(server.url + "/models", headers=server.admin_headers).json()["models"]
    demo = next(m for m in native if m["model"] == "smollm2")
    assert demo["backend"] == "llamacpp" and demo["size_bytes"] > 50_000_000
    assert demo["local_path"].endswith(DEMO_MODEL_FILE)


def test_openai_chat(oai: openai.OpenAI) -> None:
    answer = oai.chat.completions.create(
        model="smollm2", messages=PROMPT, max_tokens=12, temperature=0  # type: ignore[arg-type]
    )
    assert answer.model == "smollm2"
    assert answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.completion_tokens > 0


def test_openai_chat_stream(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model="smollm2", messages=PROMPT, max_tokens=12, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, **GREEDY,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_openai_completions(oai: openai.OpenAI) -> None:
    answer = oai.completions.create(model="smollm2", prompt="The capital of France is",
                                    max_tokens=8, temperature=0)
    assert answer.choices[0].text


def test_ollama_chat_and_generate(server: Server) -> None:
    client = ollama.Client(host=server.url, timeout=120)
    reply = client.chat(model="smollm2", messages=PROMPT, options={"num_predict": 10, **GREEDY})
    assert reply.message.content and reply.done
    assert reply.eval_count and reply.eval_count > 0
    assert reply.total_duration and reply.total_duration > 0
    parts = list(client.chat(model="smollm2", messages=PROMPT, stream=True,
                             options={"num_predict": 10, **GREEDY}))
    assert parts[-1].done and parts[-1].done_reason in ("stop", "length")
    assert "".join(p.message.content or "" for p in parts).strip()
    generated = client.generate(model="smollm2", prompt="Say hi",
                                options={"num_predict": 8, **GREEDY})
    assert generated.response and generated.done


def test_ollama_tags_show_ps(server: Server) -> None:
    client = ollama.Client(host=server.url, timeout=60)
    tags = {m.model: m for m in client.list().models}
    demo = tags["smollm2:latest"]
    assert demo.details is not None
    assert demo.details.family == "llama" and demo.details.quantization_level == "Q4_1"
    shown = client.show("smollm2")
    assert shown.modelinfo and shown.modelinfo["general.architecture"] == "llama"
    assert shown.template  # the GGUF's chat template
    client.chat(model="smollm2:latest", messages=PROMPT, options={"num_predict": 2})
    running = next(m for m in client.ps().models if m.model == "smollm2:latest")
    # A CPU engine: nothing in VRAM, and the context the demo model runs with.
    assert running.size_vram == 0 and running.size and running.size > 0
    assert running.context_length == 2048
    # From the GGUF and its chat template (the demo's renders tools), not guesses.
    assert shown.capabilities is not None
    assert {"completion", "tools"} <= set(shown.capabilities)
    assert "embedding" not in shown.capabilities
    assert shown.modelinfo["llama.context_length"] == 8192


def test_chat_ollama_validates_the_demo_model_on_init(server: Server) -> None:
    from langchain_ollama import ChatOllama

    for name in ("smollm2", "smollm2:latest"):
        llm = ChatOllama(model=name, base_url=server.url, validate_model_on_init=True,
                         num_predict=4, **GREEDY)
        assert llm.invoke("Say hi").content


def test_native_chat_raw_http(server: Server) -> None:
    body = {"model": "smollm2", "messages": PROMPT, "max_tokens": 8, **GREEDY}
    r = httpx.post(server.url + "/chat", json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    for field in ("model", "created_at", "message", "done", "done_reason", "total_duration",
                  "load_duration", "prompt_eval_count", "eval_count", "eval_duration"):
        assert field in data, field
    assert data["done"] is True and data["message"]["content"]
    assert data["eval_count"] > 0 and data["eval_duration"] > 0

    with httpx.stream("POST", server.url + "/chat", json={**body, "stream": True},
                      timeout=120) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
    assert events[-1]["done"] is True and events[-1]["delta"] == {}
    assert all(e["done"] is False for e in events[:-1])
    assert "".join(e["delta"].get("content", "") for e in events[:-1]).strip()


def _upstream(server: Server) -> str:
    status = httpx.get(server.url + "/status", headers=server.admin_headers).json()
    model = next(m for m in status["engines"][0]["models"] if m["model"] == "smollm2")
    return str(model["upstream"])


def _busy_slots(server: Server, upstream: str) -> int:
    headers = backend_headers(server.home, "smollm2")  # /slots wants the load's key
    slots = httpx.get(upstream + "/slots", headers=headers, timeout=5).json()
    return sum(1 for s in slots if s.get("is_processing"))


def test_client_disconnect_stops_generation(server: Server) -> None:
    body = {"model": "smollm2", "messages": PROMPT, "stream": True, "max_tokens": 4000,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as s:
        lines = s.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data:") for line in got)
        upstream = _upstream(server)
        assert _busy_slots(server, upstream) == 1
    # The connection is closed: llama-server must stop generating well before 4000 tokens.
    deadline = time.monotonic() + 20
    while _busy_slots(server, upstream) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _busy_slots(server, upstream) == 0

    def leases() -> int:  # back within the front's 20 ms linger (front/engines/idle_leases.py)
        status = httpx.get(server.url + "/status").json()
        return int(next(m for m in status["engines"][0]["models"] if m["model"] == "smollm2")[
            "leases"])  # fmt: skip

    poll(lambda: leases() == 0, timeout_s=5, what="the lease back at the engine")


def test_unknown_model_and_bad_request(server: Server, oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="ghost", messages=PROMPT)  # type: ignore[arg-type]
    assert err.value.code == "model_not_found"
    with pytest.raises(ollama.ResponseError) as oerr:
        ollama.Client(host=server.url).chat(model="ghost", messages=PROMPT)
    assert oerr.value.status_code == 404
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "smollm2",
                                                               "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"



def test_status_shows_memory_estimate_and_measured(server: Server, oai: openai.OpenAI) -> None:
    oai.chat.completions.create(model="smollm2", messages=PROMPT, max_tokens=2)  # type: ignore[arg-type]
    status = httpx.get(server.url + "/status").json()
    model = next(m for m in status["engines"][0]["models"] if m["model"] == "smollm2")
    memory = model["memory"]
    # ctx 2048 per slot x 4 slots: K and V for 30 layers x 3 kv heads x 64 dims in f16
    assert memory["estimate"]["kv_cache_bytes"] == 2 * 30 * 3 * 64 * 2048 * 4 * 2
    assert memory["estimate"]["weights_bytes"] > 90_000_000
    assert memory["estimate_bytes"] > memory["estimate"]["weights_bytes"]
    assert memory["measured_bytes"] > 50_000_000  # the real llama-server's resident memory


ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "required": ["a", "b"],
                   "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}  # fmt: skip


def add_call(a: int, b: int, *, ollama_shape: bool = False) -> dict[str, Any]:
    args: Any = {"a": a, "b": b}
    if ollama_shape:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "add", "arguments": args}}]}
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{a}_{b}", "type": "function",
         "function": {"name": "add", "arguments": json.dumps(args)}}]}


def add_prompt(*, ollama_shape: bool = False) -> list[dict[str, Any]]:
    """Two earlier calls in the history: the 135M demo model imitates them (at temperature 0)
    where an instruction alone makes it answer in prose. The calls are rendered by the demo
    model's tool template (templates/chatml-tools.jinja) and parsed back by llama-server."""
    return [{"role": "user", "content": "add 1 and 1"}, add_call(1, 1, ollama_shape=ollama_shape),
            {"role": "user", "content": "add 4 and 5"}, add_call(4, 5, ollama_shape=ollama_shape),
            {"role": "user", "content": "add 2 and 3"}]


def assert_adds(name: str, arguments: dict[str, Any]) -> None:
    assert name == "add"
    assert set(arguments) == {"a", "b"}
    assert all(isinstance(v, int | float) for v in arguments.values())


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_openai_tool_call_through_llama_server(oai: openai.OpenAI, tool_choice: str) -> None:
    done = oai.chat.completions.create(
        model="smollm2", messages=add_prompt(), tools=[ADD_TOOL],  # type: ignore[arg-type]
        tool_choice=tool_choice, max_tokens=48, temperature=0,  # type: ignore[arg-type]
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].id and calls[0].type == "function"
    assert_adds(calls[0].function.name, json.loads(calls[0].function.arguments))


def test_openai_tool_call_streamed(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model="smollm2", messages=add_prompt(), tools=[ADD_TOOL],  # type: ignore[arg-type]
        max_tokens=48, temperature=0, stream=True,
    )
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    deltas = 0
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for call in choice.delta.tool_calls or []:
            deltas += 1
            if call.function and call.function.name:
                names[call.index] = call.function.name
            if call.function and call.function.arguments:
                arguments[call.index] = arguments.get(call.index, "") + call.function.arguments
    assert finish == "tool_calls"
    assert list(names) == [0] and deltas > 1  # the arguments arrive in pieces
    assert_adds(names[0], json.loads(arguments[0]))


def test_ollama_client_tool_call_through_llama_server(server: Server) -> None:
    client = ollama.Client(host=server.url, timeout=120)
    assert "tools" in (client.show("smollm2").capabilities or [])
    for stream in (False, True):
        parts = client.chat(model="smollm2", messages=add_prompt(ollama_shape=True),
                            tools=[ADD_TOOL], stream=stream,
                            options={"num_predict": 48, "temperature": 0})
        replies = list(parts) if stream else [parts]
        calls = [c for r in replies for c in (r.message.tool_calls or [])]
        assert replies[-1].done and len(calls) == 1
        assert_adds(calls[0].function.name, dict(calls[0].function.arguments))


def test_session_kv_survives_an_unload_in_real_llama_server(server: Server) -> None:
    """A session's slot is saved after each turn (llama-server's /slots save) and restored into
    the fresh llama-server after the model was unloaded: turn 2 prefills only its new message."""

    def turn(content: str) -> dict[str, Any]:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "session_id": "e2e-kv", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 200, r.text
        return dict(r.json()["usage"])

    first = turn("Describe a quiet harbour town at dawn in two sentences, please.")
    saved = server.home / "session-kv"
    assert poll(lambda: list(saved.glob("*.bin")), timeout_s=10, what="the saved slot")
    r = httpx.post(server.url + "/api/generate", json={"model": "smollm2", "keep_alive": 0},
                   timeout=60)
    assert r.status_code == 200
    second = turn("And at dusk?")
    reused = second["prompt_tokens_details"]["cached_tokens"]
    # The whole of turn 1 (its prompt, most of its answer) came back from the file.
    assert reused >= first["prompt_tokens"], (first, second)
    assert second["prompt_tokens"] - reused < 30


def test_the_real_llama_server_takes_only_its_loads_key(server: Server) -> None:
    """llama-server is started with `--api-key-file` (a 0600 file of the load's random key): a
    request straight to it without that key is a 401; the front, which has it from the lease,
    gets answers; its health route stays open for readiness probes."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "max_tokens": 2, "messages": PROMPT})
    assert r.status_code == 200, r.text
    status = httpx.get(server.url + "/status", headers=server.admin_headers, timeout=10).json()
    [demo] = [m for e in status["engines"] for m in e["models"] if m["model"] == "smollm2"]
    url, body = demo["upstream"] + "/v1/chat/completions", {"max_tokens": 2, "messages": PROMPT}
    assert httpx.post(url, json=body, timeout=60).status_code == 401
    [key_file] = (server.home / "run" / "backend-keys").iterdir()
    assert key_file.stat().st_mode & 0o777 == 0o600
    keyed = httpx.post(url, json=body, timeout=60, headers=backend_headers(server.home, "smollm2"))
    assert keyed.status_code == 200, keyed.text
    assert httpx.get(demo["upstream"] + "/health", timeout=10).status_code == 200


def test_the_tool_loop_runs_an_mcp_tool_for_the_real_model(server: Server) -> None:
    """The whole server-side loop with real parts: llama-server's parsed call of the MCP
    server's `add`, the call run over stdio, its result appended, the model resumed; the
    archived transcript is that exchange."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "messages": add_prompt(), "max_tokens": 48, "temperature": 0,
        "tools": [{"type": "mcp", "server": "calc"}], "archive": "1d"})
    assert r.status_code == 200, r.text
    body = r.json()
    [round_1] = body["x_modelyard_tool_rounds"][:1]
    assert (round_1["round"], round_1["tool"], round_1["is_error"]) == (1, "add", False)
    arguments = json.loads(round_1["arguments"])
    assert_adds("add", arguments)
    assert float(round_1["result"]) == arguments["a"] + arguments["b"]  # the MCP server's sum
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    item_id = r.headers["x-modelyard-archive-id"]

    def transcript() -> Any:
        got = httpx.get(f"{server.url}/archive/{item_id}/content", headers=server.admin_headers,
                        timeout=10)
        return got.json() if got.status_code == 200 else None

    doc = poll(transcript, timeout_s=20, what="the archived transcript")
    tool_messages = [m for m in doc["messages"] if m["role"] == "tool"]
    assert tool_messages[0]["content"] == round_1["result"]
