"""Ollama's `context` on /api/generate with the real demo model, through the official `ollama`
SDK: the answer carries the exchange's token ids, and a follow-up that sends them back has the
model read that exchange before the new prompt (front/chat/ollama_context.py)."""

from __future__ import annotations

import ollama
import pytest
from tests.e2e.compat.table import covers
from tests.support import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

OPTIONS = {"num_predict": 8, "temperature": 0}


@pytest.fixture(scope="module")
def client(compat_server: Server) -> ollama.Client:
    return ollama.Client(host=compat_server.url, timeout=120)


@covers("Ollama generate `context`", "Ollama")
def test_context_round_trip(client: ollama.Client) -> None:
    first = client.generate(model="smollm2", prompt="My name is Ann.", options=OPTIONS)
    context = first.context
    assert isinstance(context, list) and context and all(isinstance(t, int) for t in context)
    # The prompt's ids, then the answer's: more than the prompt alone.
    assert len(context) > (first.prompt_eval_count or 0)
    streamed = list(client.generate(model="smollm2", prompt="What is my name?",
                                    context=context, options=OPTIONS, stream=True))
    with_context = streamed[-1]
    assert with_context.done and with_context.context is not None
    assert with_context.context[:len(context)] == context
    without = client.generate(model="smollm2", prompt="What is my name?", options=OPTIONS)
    assert (with_context.prompt_eval_count or 0) >= (without.prompt_eval_count or 0) + len(
        context) - 1  # the previous exchange is read before the new prompt
    assert (with_context.prompt_eval_count or 0) > (without.prompt_eval_count or 0)
