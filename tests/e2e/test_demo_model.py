"""End to end: the real llama-server with the real demo model, through modelyard's front and
engine processes, driven by the official `openai` and `ollama` clients and raw HTTP.

One modelyard server (so one llama-server) is shared by the whole module.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import ollama
import openai
import pytest
from tests.support import Server, require_e2e_artifact

from modelyard.config import DEMO_MODEL_FILE, Settings, cache_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PROMPT = [{"role": "user", "content": "Name one colour of the rainbow."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_e2e_artifact(Settings().resolve_llama_server(), "llama-server")
    gguf = require_e2e_artifact(cache_dir() / "models" / DEMO_MODEL_FILE, "the demo model")
    home = tmp_path_factory.mktemp("e2e-home")
    (home / "models").mkdir()
    (home / "models" / DEMO_MODEL_FILE).symlink_to(gguf)
    # No config models: the demo model must be found and named `smollm2` by itself.
    srv = Server(home, {"scan_hf_cache": False, "default_ctx_size": 2048})
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
    native = httpx.get(server.url + "/models").json()["models"]
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
        stream_options={"include_usage": True},
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
    reply = client.chat(model="smollm2", messages=PROMPT, options={"num_predict": 10})
    assert reply.message.content and reply.done
    assert reply.eval_count and reply.eval_count > 0
    assert reply.total_duration and reply.total_duration > 0
    parts = list(client.chat(model="smollm2", messages=PROMPT, stream=True,
                             options={"num_predict": 10}))
    assert parts[-1].done and parts[-1].done_reason in ("stop", "length")
    assert "".join(p.message.content or "" for p in parts).strip()
    generated = client.generate(model="smollm2", prompt="Say hi", options={"num_predict": 8})
    assert generated.response and generated.done


def test_ollama_tags_show_ps(server: Server) -> None:
    client = ollama.Client(host=server.url, timeout=60)
    tags = {m.model: m for m in client.list().models}
    demo = tags["smollm2"]
    assert demo.details is not None
    assert demo.details.family == "llama" and demo.details.quantization_level == "Q4_1"
    shown = client.show("smollm2")
    assert shown.modelinfo and shown.modelinfo["general.architecture"] == "llama"
    assert shown.template  # the GGUF's chat template
    client.chat(model="smollm2", messages=PROMPT, options={"num_predict": 2})
    assert "smollm2" in [m.model for m in client.ps().models]


def test_native_chat_raw_http(server: Server) -> None:
    body = {"model": "smollm2", "messages": PROMPT, "max_tokens": 8}
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
    status = httpx.get(server.url + "/status").json()
    model = next(m for m in status["engines"][0]["models"] if m["model"] == "smollm2")
    return str(model["upstream"])


def _busy_slots(upstream: str) -> int:
    slots = httpx.get(upstream + "/slots", timeout=5).json()
    return sum(1 for s in slots if s.get("is_processing"))


def test_client_disconnect_stops_generation(server: Server) -> None:
    body = {"model": "smollm2", "messages": PROMPT, "stream": True, "max_tokens": 4000,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as s:
        lines = s.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data:") for line in got)
        upstream = _upstream(server)
        assert _busy_slots(upstream) == 1
    # The connection is closed: llama-server must stop generating well before 4000 tokens.
    deadline = time.monotonic() + 20
    while _busy_slots(upstream) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _busy_slots(upstream) == 0
    status = httpx.get(server.url + "/status").json()
    model = next(m for m in status["engines"][0]["models"] if m["model"] == "smollm2")
    assert model["leases"] == 0


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


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip
TOOL_PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_ollama_client_with_tools(server: Server) -> None:
    """Ollama has no tool_choice, so the tiny model may answer in text or call the tool: either
    way the answer is well formed, and /api/show says the model can call tools."""
    client = ollama.Client(host=server.url, timeout=120)
    assert "tools" in (client.show("smollm2").capabilities or [])
    reply = client.chat(model="smollm2", messages=TOOL_PROMPT, tools=[WEATHER_TOOL],
                        options={"num_predict": 48, "temperature": 0})
    assert reply.done
    for call in reply.message.tool_calls or []:
        assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    assert reply.message.tool_calls or reply.message.content
