"""litellm's OpenAI, Ollama and Anthropic providers, unchanged, against modelyard."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from tests.e2e.compat.table import covers
from tests.support import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PROMPT = [{"role": "user", "content": "Name one colour of the rainbow."}]
# The answers' text is asserted: greedy, as a sampled answer may end at once (no `seed`: litellm
# refuses it for its Anthropic provider).
GREEDY: dict[str, Any] = {"temperature": 0}


@pytest.fixture(scope="module")
def litellm() -> Iterator[Any]:
    # No network here: litellm must read its bundled model-cost map, not fetch it.
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    import litellm as module

    module.telemetry = False
    yield module


@covers("litellm", "OpenAI", "Ollama", "Anthropic")
def test_three_providers(litellm: Any, compat_server: Server) -> None:
    for model, base in (("openai/smollm2", compat_server.url + "/v1"),
                        ("ollama_chat/smollm2", compat_server.url),
                        ("anthropic/smollm2", compat_server.url)):
        answer = litellm.completion(model=model, api_base=base, api_key="unused",
                                    messages=PROMPT, max_tokens=8, timeout=120, **GREEDY)
        assert answer.choices[0].message.content, model
        assert answer.usage.prompt_tokens > 5, model
        chunks = list(litellm.completion(model=model, api_base=base, api_key="unused",
                                         messages=PROMPT, max_tokens=8, stream=True,
                                         timeout=120, **GREEDY))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), model


@covers("Embeddings", "OpenAI", "Ollama")
def test_embeddings(litellm: Any, compat_server: Server) -> None:
    for model, base in (("openai/all-minilm", compat_server.url + "/v1"),
                        ("ollama/all-minilm", compat_server.url)):
        out = litellm.embedding(model=model, api_base=base, api_key="unused",
                                input=["a cat"], timeout=120)
        assert len(out.data[0]["embedding"]) == 384, model


@covers("Context overflow is recognisable", "OpenAI")
def test_context_window_exceeded(litellm: Any, compat_server: Server) -> None:
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model="openai/smollm2", api_base=compat_server.url + "/v1",
                           api_key="unused", max_tokens=4, timeout=120,
                           messages=[{"role": "user", "content": "word " * 5000}])
