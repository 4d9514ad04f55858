"""The transformers engine answers a prompt longer than the context in llama-server's shape
(`exceed_context_size_error` with the counts), so the front gives both backends' overflows each
API's own error (front/chat/openai_compat.py): OpenAI's `context_length_exceeded`."""

from __future__ import annotations

from typing import Any, cast

import pytest
from starlette.testclient import TestClient

from modelyard.engine.backends.transformers.generator import BatchGenerator
from modelyard.engine.backends.transformers.params import ContextOverflow, SamplingParams
from modelyard.engine.backends.transformers.server import build_app
from modelyard.front.chat.openai_compat import context_overflow, openai_error

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class _FullContext:
    """A generator whose context (8 tokens) every prompt overflows."""

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 session: str | None = None, constraint: Any = None) -> Any:  # fmt: skip
        raise ContextOverflow(len(prompt_ids), 8)


def test_an_overflow_is_answered_as_llama_server_does_and_translated() -> None:
    app = build_app("tiny", cast(BatchGenerator, _FullContext()),
                    chat_ids=lambda body: list(range(12)), prompt_ids=lambda body: list(range(12)))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "exceed_context_size_error"
    assert context_overflow(r.status_code, r.content) == (12, 8)
    shaped = openai_error(r.status_code, r.content, infill=False)
    assert shaped is not None and shaped[0] == 400
    assert b'"code":"context_length_exceeded"' in shaped[1]
