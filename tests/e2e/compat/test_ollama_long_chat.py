"""A conversation longer than the context, with the official `ollama` client and litellm,
against modelyard on its embedded defaults (the demo model at 2,048 tokens per slot): Ollama
drops the oldest turns (front/chat/ollama_fit.py), so a long Open WebUI chat keeps working, and
a generate prompt keeps its end; only a last message longer than the context is refused."""

from __future__ import annotations

import os
from typing import Any

import ollama
import pytest
from tests.e2e.compat.table import covers
from tests.support import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CTX = 2048  # the compat server's context per slot (tests/e2e/compat/conftest.py)
GREEDY = {"temperature": 0, "seed": 7}


@pytest.fixture(scope="module")
def client(compat_server: Server) -> ollama.Client:
    return ollama.Client(host=compat_server.url, timeout=240)


def long_history() -> list[dict[str, str]]:
    """A system message, 40 exchanges of ~60 words each way (some 8,000 tokens), a question."""
    filler = " ".join(["the weather was mild and the garden was green"] * 6)
    out = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}]
    for n in range(40):
        out += [{"role": "user", "content": f"Day {n}: {filler}. What happened?"},
                {"role": "assistant", "content": f"On day {n}, {filler}."}]
    return [*out, {"role": "user", "content": "Name one colour of the rainbow."}]


@covers("Prompt longer than the context", "Ollama")
def test_a_chat_far_beyond_num_ctx_is_answered_within_it(client: ollama.Client) -> None:
    answer = client.chat(model="smollm2", messages=long_history(),
                         options={"num_ctx": CTX, "num_predict": 8, **GREEDY})
    assert answer.message.content and answer.done
    assert 0 < (answer.prompt_eval_count or 0) <= CTX
    chunks = list(client.chat(model="smollm2", messages=long_history(), stream=True,
                              options={"num_ctx": CTX, "num_predict": 8, **GREEDY}))
    assert "".join(c.message.content or "" for c in chunks)
    assert 0 < (chunks[-1].prompt_eval_count or 0) <= CTX


@covers("Prompt longer than the context", "Ollama")
def test_a_generate_prompt_beyond_the_context_keeps_its_end(client: ollama.Client) -> None:
    prompt = "word " * 4000 + "\nName one colour of the rainbow."
    answer = client.generate(model="smollm2", prompt=prompt, options={"num_predict": 8, **GREEDY})
    # Answered (the demo model may answer the cut prompt with nothing: its text is not asked).
    assert answer.done and answer.done_reason in ("stop", "length")
    assert 0 < (answer.prompt_eval_count or 0) <= CTX
    assert answer.context and len(answer.context) <= CTX  # what the model read, and its answer


@pytest.fixture(scope="module")
def litellm() -> Any:
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no network: its bundled map
    import litellm as module

    module.telemetry = False
    return module


def overflow(litellm: Any, compat_server: Server) -> Any:
    """litellm's `ollama_chat/` with one message longer than the context."""
    return litellm.completion(model="ollama_chat/smollm2", api_base=compat_server.url,
                              max_tokens=4, timeout=240, num_retries=0,
                              messages=[{"role": "user", "content": "word " * 5000}])


@covers("Context overflow is recognisable", "Ollama")
def test_litellm_ollama_chat_sees_a_400_whose_text_it_knows_as_an_overflow(
        litellm: Any, compat_server: Server) -> None:
    from litellm.litellm_core_utils.exception_mapping_utils import ExceptionCheckers

    with pytest.raises(litellm.BadRequestError) as err:
        overflow(litellm, compat_server)
    assert err.value.status_code == 400
    assert "maximum context length is 2048 tokens" in str(err.value)
    assert ExceptionCheckers.is_error_str_context_window_exceeded(str(err.value))


@pytest.mark.xfail(strict=True, reason="litellm 1.110 maps no ollama/ollama_chat error to "
                   "ContextWindowExceededError: its _map_ollama_exception checks four other "
                   "texts, then the status (400: BadRequestError); XPASS when litellm learns it")
def test_litellm_ollama_chat_raises_context_window_exceeded(litellm: Any,
                                                            compat_server: Server) -> None:
    with pytest.raises(litellm.ContextWindowExceededError):
        overflow(litellm, compat_server)
