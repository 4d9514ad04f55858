"""Ollama's cut of a prompt longer than the context over real sockets (front/chat/ollama_fit.py):
/api/chat drops the oldest turns, keeping the system message and the last message; /api/generate
keeps the end of its prompt; only a chat whose system and last message alone overflow is a 400.

The backend is the fake llama-server (tests/fakes/fake_backend.py) with a context of CTX
tokens, counted as it counts them (a word is a token) and refused as llama-server refuses
(`exceed_context_size_error` with the counts).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tests.fakes.fake_backend import BOS_ID, word_id
from tests.integration.harness import config, module_server
from tests.integration.test_ollama_context import chunks as answers
from tests.integration.test_ollama_context import gguf_fake, received
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

CTX = 40


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    files = tmp_path_factory.mktemp("ggufs")
    local = gguf_fake("local", files)
    local["argv"] = [*local["argv"], "-c", str(CTX)]
    models = [fake_model("short", "-c", str(CTX)), local]
    with module_server(tmp_path_factory, config(*models)) as s:
        yield s


def post(server: Server, path: str, body: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def words(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m.get("content", "")).split()) for m in messages)


def history(turns: int) -> list[dict[str, Any]]:
    """A system message and `turns` exchanges of five words each way, then a question."""
    out = [{"role": "system", "content": "be brief"}]
    for n in range(turns):
        out += [{"role": "user", "content": f"question {n} one two three"},
                {"role": "assistant", "content": f"answer {n} four five six"}]
    return [*out, {"role": "user", "content": "and the last question"}]


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_longer_than_the_context_loses_its_oldest_turns(server: Server,
                                                              stream: bool) -> None:
    messages = history(20)  # 206 words against 40
    r = post(server, "/api/chat", {"model": "short", "messages": messages, "stream": stream,
                                   "options": {"num_predict": 3}})
    final = answers(r, stream)[-1]
    assert final["done"] is True and final["prompt_eval_count"] <= CTX
    sent = received(server, "short")[-1]["messages"]
    assert sent[0] == {"role": "system", "content": "be brief"}
    assert sent[-1] == {"role": "user", "content": "and the last question"}
    assert sent[1]["role"] == "user"  # whole turns: it begins with a question
    kept = sent[1:]
    assert kept == messages[len(messages) - len(kept):]  # the latest, in order
    assert len(kept) >= 3 and words(sent) <= CTX


def test_a_chat_that_fits_is_sent_whole(server: Server) -> None:
    messages = history(2)
    r = post(server, "/api/chat", {"model": "short", "messages": messages, "stream": False,
                                   "options": {"num_predict": 2}})
    assert r.status_code == 200, r.text
    # The last request upstream is the whole chat: it was answered, so nothing was cut.
    assert received(server, "short")[-1]["messages"] == messages


def test_a_last_message_longer_than_the_context_is_a_400(server: Server) -> None:
    messages = [*history(3)[:-1], {"role": "user", "content": "word " * (CTX + 5)}]
    r = post(server, "/api/chat", {"model": "short", "messages": messages, "stream": False})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "maximum context length is 40 tokens" in error, error
    # The last try was the system message and the last message alone.
    assert received(server, "short")[-1]["messages"] == [messages[0], messages[-1]]


@pytest.mark.parametrize("stream", [False, True])
def test_a_long_generate_prompt_keeps_its_end(server: Server, stream: bool) -> None:
    prompt = " ".join(f"w{n}" for n in range(100))
    r = post(server, "/api/generate", {"model": "short", "prompt": prompt, "stream": stream,
                                       "system": "be brief", "options": {"num_predict": 2}})
    final = answers(r, stream)[-1]
    assert final["done"] is True and final["prompt_eval_count"] <= CTX
    sent = received(server, "short")[-1]["messages"]
    assert sent[0] == {"role": "system", "content": "be brief"}
    assert sent[-1]["content"].endswith(" w98 w99") and words(sent) <= CTX


def test_a_long_generate_prompt_of_token_ids_keeps_its_start_and_end(server: Server) -> None:
    prompt = " ".join(f"w{n}" for n in range(100))
    r = post(server, "/api/generate", {"model": "local", "prompt": prompt, "stream": False,
                                       "options": {"num_predict": 2}})
    assert r.status_code == 200, r.text
    full = [BOS_ID, *(word_id(w) for w in f"<|user|> {prompt} <|assistant|>".split())]
    sent = received(server, "local")[-1]["prompt"]
    assert len(sent) <= CTX - 2 and sent[:4] == full[:4] and sent[4:] == full[-(len(sent) - 4):]
    final = r.json()
    assert final["prompt_eval_count"] == len(sent)
    assert final["context"] == [*sent, 0, 1]  # what the model read, and its answer
