"""Schemathesis hooks for the fuzz tier (loaded by the CLI through SCHEMATHESIS_HOOKS).

Most inference and service bodies are pointed at the fake model (or service) so they reach a
backend instead of stopping at model_not_found, and the tokens they ask for are capped: the fake
generates as many as asked, with no context to stop it as llama-server's does, so a generated
max_tokens of 10^9 would only measure the fake.
"""

from __future__ import annotations

from typing import Any

import schemathesis

MODEL = "m"  # the fake model of tests/fuzz/test_fuzz_api.py's server
SERVICES = {"tts": "speech", "stt": "transcription", "painter": "image"}  # and its services
SERVICE_FOR = {"/v1/audio/speech": "tts", "/v1/audio/transcriptions": "stt",
               "/v1/images/generations": "painter"}
INFERENCE = {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/api/chat",
             "/api/generate", "/api/embed", "/api/embeddings", "/chat", "/api/show",
             "/v1/messages", "/v1/messages/count_tokens"}
LIMITS = ("max_tokens", "max_completion_tokens", "n_predict", "num_predict")
MAX_TOKENS = 32


def aim(path: str, body: Any) -> Any:
    """The generated model name stays where its length is a multiple of 3 (unknown models are
    fuzzed too)."""
    if not isinstance(body, dict) or (path not in INFERENCE and path not in SERVICE_FOR):
        return body
    if isinstance(body.get("model"), str) and len(body["model"]) % 3:
        body["model"] = SERVICE_FOR.get(path, MODEL)
    for where in (body, body.get("options")):
        if not isinstance(where, dict):
            continue
        for key in LIMITS:
            value = where.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
                where[key] = MAX_TOKENS
    return body


@schemathesis.hook
def map_body(context: schemathesis.HookContext, body: Any) -> Any:
    assert context.operation is not None
    return aim(context.operation.path, body)
