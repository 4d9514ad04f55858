"""Constrained decoding on the real demo model (SmolLM2-135M-Instruct as safetensors), served by
the transformers engine's own HTTP app in this process: a schema the model violates when left
alone is followed under `response_format`, and a forced tool call names the right function,
although the model's chat template teaches no tool-call format at all."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from tests.support import demo_batch_generator

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "population": {"type": "integer", "minimum": 0, "maximum": 10**9}}}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "required": ["query"], "additionalProperties": False,
        "properties": {"query": {"type": "string", "maxLength": 40}}}}},
    {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 20}}}}},
]


@pytest.fixture(scope="module")
def loaded() -> Iterator[Any]:
    with demo_batch_generator() as (model, tokenizer, gen):
        yield model, tokenizer, gen


@pytest.fixture
async def client(loaded: Any) -> AsyncIterator[httpx.AsyncClient]:
    from modelyard.engine.backends.transformers.constraints import Compiler
    from modelyard.engine.backends.transformers.loader import chat_prompt_ids
    from modelyard.engine.backends.transformers.server import build_app
    from modelyard.engine.backends.transformers.tool_calls import tool_family_of

    model, tokenizer, gen = loaded
    compiler = Compiler(tokenizer, gen.eos_ids, model.config.vocab_size)
    app = build_app("smol", gen, lambda body: chat_prompt_ids(tokenizer, body),
                    lambda body: [], tool_family=tool_family_of(tokenizer),
                    constrain=compiler.for_request)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://smol", timeout=240) as c:
        yield c


async def chat(client: httpx.AsyncClient, **extra: Any) -> dict[str, Any]:
    body = {"messages": QUESTION, "temperature": 0, "max_tokens": 48, **extra}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


async def test_the_demo_model_follows_a_schema_it_otherwise_violates(
        client: httpx.AsyncClient) -> None:
    free = (await chat(client, max_tokens=16))["choices"][0]["message"]["content"]
    with pytest.raises((ValueError, jsonschema.ValidationError)):  # prose, not this JSON
        jsonschema.validate(json.loads(free), CITY)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    data = await chat(client, response_format=fmt)
    assert data["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(data["choices"][0]["message"]["content"]), CITY)


async def test_the_demo_model_makes_the_forced_tool_call(client: httpx.AsyncClient) -> None:
    named = {"type": "function", "function": {"name": "weather"}}
    data = await chat(client, tools=TOOLS, tool_choice=named)
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "weather"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
