"""Ollama's generation fields over real sockets (issue 18): a true `prompt_eval_count` when the
backend reuses its prompt cache, `think` (the backend's `reasoning_content` as `thinking`),
and what /api/generate sends upstream for `template`, `raw` and `think`.

The backend is the fake llama-server (tests/fakes/fake_backend.py): `--parallel 1` models its
prompt cache, `--reasoning` a reasoning model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from tests.e2e.compat.table import covers
from tests.integration.harness import TEXT_16, config, model_status, module_server
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

REASONING = "The user wants an answer. I will give one."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    models = [fake_model("cached", "--parallel", "1"), fake_model("thinker", "--reasoning"),
              fake_model("plain"), fake_model("ctx", "-c", "$ctx", ctx_size=4096)]
    with module_server(tmp_path_factory, config(*models)) as s:
        yield s


def post(server: Server, path: str, body: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def lines(response: httpx.Response) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in response.text.splitlines() if line.strip()]


def sent(server: Server, model: str) -> dict[str, Any]:
    """The last request body the model's backend got (the fake's GET /requests)."""
    found = model_status(server, model)
    assert found is not None
    received: list[dict[str, Any]] = httpx.get(found["upstream"] + "/requests", timeout=10).json()
    return received[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_eval_count_counts_the_cached_prompt(server: Server, stream: bool) -> None:
    """The same chat twice: the second reuses the backend's cache, and still counts its whole
    prompt (it read 1 before: llama-server's prompt_n is only the newly evaluated tokens)."""
    body = {"model": "cached", "stream": stream,
            "messages": [{"role": "user", "content": f"count my words please {stream}"}]}
    first = post(server, "/api/chat", body)
    second = post(server, "/api/chat", body)
    finals = [(lines(r) if stream else [r.json()])[-1] for r in (first, second)]
    assert [f["prompt_eval_count"] for f in finals] == [6, 6]  # role + 5 words, both times


@covers("Thinking", "Ollama")
def test_think_streams_the_reasoning_as_thinking(server: Server) -> None:
    body = {"model": "thinker", "think": True, "messages": [{"role": "user", "content": "hi"}]}
    chunks = lines(post(server, "/api/chat", body))
    thinking = [c["message"]["thinking"] for c in chunks if c["message"].get("thinking")]
    assert len(thinking) == 2 and "".join(thinking) == REASONING
    assert "".join(c["message"]["content"] for c in chunks) == TEXT_16
    assert chunks[-1]["done"] is True
    upstream = sent(server, "thinker")
    assert upstream["chat_template_kwargs"] == {"enable_thinking": True}
    assert upstream["reasoning_format"] == "deepseek"


def test_think_whole_answers_and_generate(server: Server) -> None:
    chat = post(server, "/api/chat", {"model": "thinker", "think": True, "stream": False,
                                      "messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["message"]["thinking"] == REASONING and chat["message"]["content"] == TEXT_16
    gen = post(server, "/api/generate", {"model": "thinker", "think": "high", "stream": False,
                                         "prompt": "hi"}).json()
    assert gen["thinking"] == REASONING and gen["response"] == TEXT_16
    assert sent(server, "thinker")["chat_template_kwargs"] == {
        "enable_thinking": True, "reasoning_effort": "high"}
    streamed = lines(post(server, "/api/generate", {"model": "thinker", "think": True,
                                                    "prompt": "hi"}))
    assert "".join(c.get("thinking", "") for c in streamed) == REASONING


def test_think_false_turns_it_off(server: Server) -> None:
    chat = post(server, "/api/chat", {"model": "thinker", "think": False, "stream": False,
                                      "messages": [{"role": "user", "content": "hi"}]}).json()
    assert "thinking" not in chat["message"] and chat["message"]["content"] == TEXT_16
    assert sent(server, "thinker")["chat_template_kwargs"] == {"enable_thinking": False}


def test_think_that_is_not_a_switch_is_a_400(server: Server) -> None:
    r = post(server, "/api/chat", {"model": "plain", "think": "very",
                                   "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "think" in r.json()["error"]


def argv_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")


def test_num_ctx_beyond_the_models_context_runs_a_larger_instance(server: Server) -> None:
    """options.num_ctx 6000 on a model served with 4096: the context variant `ctx@ctx8192` (a
    model of its own, its own server started with that context, rounded up to a power of two)
    answers it."""
    body = {"model": "ctx", "stream": False, "options": {"num_ctx": 6000},
            "messages": [{"role": "user", "content": "a long prompt"}]}
    r = post(server, "/api/chat", body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "ctx"  # the client's name, not the variant's
    variant = model_status(server, "ctx@ctx8192")
    assert variant is not None and variant["state"] == "ready"
    argv = argv_of(variant["pid"])
    assert argv[argv.index("-c") + 1] == "8192"
    base = model_status(server, "ctx")
    assert base is None or base["state"] != "ready"  # nothing loaded the default instance
    # a num_ctx the model's own context covers: the model as it is
    small = {**body, "options": {"num_ctx": 2048}}
    assert post(server, "/api/generate", {**small, "prompt": "hi"}).status_code == 200
    base = model_status(server, "ctx")
    assert base is not None and base["state"] == "ready"
    assert argv_of(base["pid"])[argv_of(base["pid"]).index("-c") + 1] == "4096"


def test_num_ctx_that_is_not_a_count_is_a_400(server: Server) -> None:
    r = post(server, "/api/chat", {"model": "ctx", "options": {"num_ctx": "lots"},
                                   "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "num_ctx" in r.json()["error"]


@pytest.mark.parametrize("stream", [False, True])
@covers("Fill in the middle (suffix)", "Ollama")
def test_suffix_fills_in_the_middle_through_infill(server: Server, stream: bool) -> None:
    body = {"model": "plain", "stream": stream, "prompt": "def add(a, b):",
            "suffix": "return c", "options": {"num_predict": 3}}
    r = post(server, "/api/generate", body)
    assert r.status_code == 200, r.text
    final = lines(r)[-1] if stream else r.json()
    text = "".join(c["response"] for c in lines(r)) if stream else final["response"]
    assert text == "The quick brown" and final["done_reason"] == "length"
    assert final["eval_count"] == 3 and final["prompt_eval_count"] == 5
    upstream = sent(server, "plain")
    assert (upstream["input_prefix"], upstream["input_suffix"]) == ("def add(a, b):", "return c")
    assert upstream["n_predict"] == 3 and "messages" not in upstream


def test_template_goes_to_the_completion_endpoint(server: Server) -> None:
    body = {"model": "plain", "stream": False, "prompt": "Hi", "system": "Be brief.",
            "template": "{{ if .System }}[S]{{ .System }}{{ end }}[U]{{ .Prompt }}[A]"
                        "{{ .Response }}[END]"}
    r = post(server, "/api/generate", body)
    assert r.status_code == 200 and r.json()["response"] == TEXT_16
    assert sent(server, "plain")["prompt"] == "[S]Be brief.[U]Hi[A]"
    bad = post(server, "/api/generate", {**body, "template": "{{ range .Messages }}{{ end }}"})
    assert bad.status_code == 400 and "range .Messages" in bad.json()["error"]
