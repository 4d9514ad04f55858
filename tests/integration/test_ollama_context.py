"""Ollama's `context` on /api/generate over real sockets: the final chunk carries the token ids
of the exchange (templated prompt + answer), and a `context` sent back is followed by the new
prompt (front/chat/ollama_context.py).

The backend is the fake llama-server (tests/fakes/fake_backend.py) run as a llama.cpp model:
its /apply-template, /tokenize and native /completion with `return_tokens`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from tests.fakes.fake_backend import BOS_ID, word_id
from tests.integration.harness import config, model_status, module_server
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def gguf_fake(model_id: str, files: Path) -> dict[str, Any]:
    """A llama.cpp model (a GGUF path: no chat template that thinks) served by the fake."""
    weights = files / f"{model_id}.gguf"
    weights.write_bytes(b"GGUF" + b"\x00" * 20)
    return {**fake_model(model_id), "backend": "llamacpp", "path": str(weights)}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    files = tmp_path_factory.mktemp("ggufs")
    models = [gguf_fake("local", files), fake_model("remote")]
    with module_server(tmp_path_factory, config(*models)) as s:
        yield s


def post(server: Server, body: Any) -> httpx.Response:
    return httpx.post(server.url + "/api/generate", json=body, timeout=30)


def chunks(response: httpx.Response, stream: bool) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    if not stream:
        return [response.json()]
    return [orjson.loads(line) for line in response.text.splitlines() if line.strip()]


def received(server: Server, model: str) -> list[dict[str, Any]]:
    found = model_status(server, model)
    assert found is not None
    got: list[dict[str, Any]] = httpx.get(found["upstream"] + "/requests", timeout=10).json()
    return got


def ids(text: str) -> list[int]:
    return [word_id(w) for w in text.split()]


@pytest.mark.parametrize("stream", [False, True])
def test_the_final_chunk_carries_the_exchange_as_token_ids(server: Server, stream: bool) -> None:
    r = post(server, {"model": "local", "stream": stream, "prompt": "hello there",
                      "system": "be brief", "options": {"num_predict": 3}})
    got = chunks(r, stream)
    final = got[-1]
    assert final["done"] is True
    assert "".join(c["response"] for c in got) == "The quick brown"
    prompt = [BOS_ID, *ids("<|system|> be brief <|user|> hello there <|assistant|>")]
    assert final["context"] == [*prompt, 0, 1, 2]  # the answer's ids: token i is i
    assert all("context" not in c for c in got[:-1])
    upstream = received(server, "local")[-1]
    assert upstream["prompt"] == prompt and upstream["return_tokens"] is True
    assert upstream["n_predict"] == 3 and "messages" not in upstream
    assert final["prompt_eval_count"] == len(prompt) and final["eval_count"] == 3


@pytest.mark.parametrize("stream", [False, True])
def test_a_context_sent_back_is_followed_by_the_new_prompt(server: Server, stream: bool) -> None:
    first = post(server, {"model": "local", "stream": False, "prompt": "my name is Ann",
                          "options": {"num_predict": 2}}).json()
    context = first["context"]
    r = post(server, {"model": "local", "stream": stream, "prompt": "what is my name",
                      "context": context, "options": {"num_predict": 2}})
    final = chunks(r, stream)[-1]
    turn = ids("<|user|> what is my name <|assistant|>")  # no second BOS mid-exchange
    assert received(server, "local")[-1]["prompt"] == [*context, *turn]
    assert final["context"] == [*context, *turn, 0, 1]
    assert final["prompt_eval_count"] == len(context) + len(turn)


def test_a_template_override_is_tokenized_as_it_renders(server: Server) -> None:
    r = post(server, {"model": "local", "stream": False, "prompt": "Hi",
                      "template": "[U] {{ .Prompt }} [A]{{ .Response }}",
                      "options": {"num_predict": 1}})
    prompt = [BOS_ID, *ids("[U] Hi [A]")]
    assert r.json()["context"] == [*prompt, 0]
    got = received(server, "local")
    assert got[-1]["prompt"] == prompt
    assert "messages" not in got[-2]  # /tokenize, not /apply-template, came before
    assert got[-2]["content"] == "[U] Hi [A]"


def test_a_raw_prompt_has_no_context_and_ignores_one(server: Server) -> None:
    r = post(server, {"model": "local", "stream": False, "prompt": "just text", "raw": True,
                      "context": [5, 6]})
    assert r.status_code == 200 and "context" not in r.json()
    assert received(server, "local")[-1]["prompt"] == "just text"


@pytest.mark.parametrize("context", ["1 2 3", [1, "2"], [True], [-1], {"ids": [1]}])
def test_a_context_that_is_not_token_ids_is_a_400(server: Server, context: Any) -> None:
    r = post(server, {"model": "local", "prompt": "hi", "context": context})
    assert r.status_code == 400 and "context" in r.json()["error"]


def test_a_model_not_served_by_llama_cpp_has_no_context(server: Server) -> None:
    r = post(server, {"model": "remote", "stream": False, "prompt": "hi",
                      "options": {"num_predict": 2}})
    assert r.status_code == 200 and "context" not in r.json()
    assert r.json()["response"] == "The quick"
    refused = post(server, {"model": "remote", "prompt": "hi", "context": [1, 2]})
    assert refused.status_code == 400 and "llama.cpp" in refused.json()["error"]


@pytest.mark.parametrize(("fmt", "schema"), [
    ("json", {"type": "object"}),
    ({"type": "object", "required": ["a"]}, {"type": "object", "required": ["a"]}),
])
def test_format_goes_to_the_native_route_as_its_json_schema(server: Server, fmt: Any,
                                                            schema: Any) -> None:
    r = post(server, {"model": "local", "stream": False, "prompt": "hi", "format": fmt,
                      "options": {"num_predict": 1}})
    assert r.status_code == 200 and r.json()["context"]
    upstream = received(server, "local")[-1]
    assert upstream["json_schema"] == schema and "response_format" not in upstream
