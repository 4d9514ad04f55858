"""Constrained decoding in the transformers engine (llguidance): the tiny random model, which
left alone never writes JSON, answers `response_format` and forced `tool_choice` requests with
output that parses and validates, in one continuous batch with other schemas and with
unconstrained rows; a request the grammar cannot be built from is a 400 with a code."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import pytest

from modelyard.engine.backends.transformers.constraints import Compiler
from modelyard.engine.backends.transformers.generator import BatchGenerator
from modelyard.engine.backends.transformers.server import build_app

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

COLOR = {"type": "object", "additionalProperties": False, "required": ["color", "ok"],
         "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}}
POINT = {"type": "object", "additionalProperties": False, "required": ["x", "tags"],
         "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                        "tags": {"type": "array", "maxItems": 2,
                                 "items": {"enum": ["a", "b"]}}}}
WEATHER_ARGS = {"type": "object", "additionalProperties": False, "required": ["city"],
                "properties": {"city": {"enum": ["Oslo", "Rome"]}}}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER_ARGS}},
    {"type": "function", "function": {"name": "time", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET"]}}}}},
]


def chat_ids(tokenizer: Any) -> Any:
    return lambda body: [int(i) for m in body["messages"] for i in tokenizer.encode(m["content"])]


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> Compiler:
    return Compiler(tokenizer, [tokenizer.eos_token_id])


@pytest.fixture
async def served(model: Any, tokenizer: Any, compiler: Compiler
                 ) -> AsyncIterator[tuple[httpx.AsyncClient, BatchGenerator]]:
    gen = BatchGenerator(model, tokenizer, max_batch_size=8)
    gen.start()
    app = build_app("tiny", gen, chat_ids(tokenizer),
                    lambda body: [int(i) for i in tokenizer.encode(body["prompt"])],
                    constrain=compiler.for_request)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://tiny") as client:
            yield client, gen
    finally:
        gen.stop()


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


async def chat(client: httpx.AsyncClient, content: str = "Hello world!",
               **extra: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 120, **extra}
    return await client.post("/v1/chat/completions", json=body)


async def answer(client: httpx.AsyncClient, **extra: Any) -> dict[str, Any]:
    r = await chat(client, **extra)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


async def test_unconstrained_the_tiny_model_writes_no_json(served: Any) -> None:
    """The premise of the tests below: without a grammar the output violates the schema."""
    client, _ = served
    for seed in range(3):
        reply = await answer(client, seed=seed, max_tokens=30)
        text = reply["choices"][0]["message"]["content"]
        with pytest.raises(ValueError):
            json.loads(text)


async def test_json_schema_output_parses_and_validates(served: Any) -> None:
    client, _ = served
    for seed in range(4):  # sampled, temperature 1: any token the grammar admits may come
        data = await answer(client, seed=seed, response_format=schema_format(COLOR))
        choice = data["choices"][0]
        assert choice["finish_reason"] == "stop"  # the grammar completed, not max_tokens
        jsonschema.validate(json.loads(choice["message"]["content"]), COLOR)


async def test_json_object_output_is_an_object(served: Any) -> None:
    client, _ = served
    data = await answer(client, temperature=0, response_format={"type": "json_object"},
                        max_tokens=200)
    choice = data["choices"][0]
    if choice["finish_reason"] == "stop":  # an open object may run to max_tokens
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:
        assert choice["message"]["content"].startswith("{")


async def test_completions_honour_response_format(served: Any) -> None:
    client, _ = served
    r = await client.post("/v1/completions", json={
        "prompt": "The quick brown fox", "max_tokens": 120, "seed": 3,
        "response_format": schema_format(POINT)})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), POINT)


async def test_concurrent_requests_with_different_schemas_share_a_batch(served: Any) -> None:
    client, gen = served
    formats: list[dict[str, Any] | None] = [COLOR, POINT, None, COLOR, POINT]
    replies = await asyncio.gather(*(
        answer(client, seed=n, max_tokens=60,
               **({"response_format": schema_format(s)} if s else {"ignore_eos": True}))
        for n, s in enumerate(formats)))
    for schema, reply in zip(formats, replies, strict=True):
        text = reply["choices"][0]["message"]["content"]
        if schema is None:
            assert reply["usage"]["completion_tokens"] == 60  # unconstrained: ran its course
        else:
            jsonschema.validate(json.loads(text), schema)
    hist = gen.stats()["batch_size_hist"]
    assert max(int(size) for size in hist) >= 3, hist  # decoded together, not one by one


async def test_streamed_json_schema_output_validates(served: Any) -> None:
    client, _ = served
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 120, "seed": 7,
            "stream": True, "response_format": schema_format(COLOR)}
    text, finish = "", None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                text += choice["delta"].get("content", "")
                finish = choice["finish_reason"] or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), COLOR)


async def test_logprobs_stay_finite_under_a_grammar(served: Any) -> None:
    client, _ = served
    data = await answer(client, seed=1, logprobs=True, top_logprobs=5,
                        response_format=schema_format(COLOR))
    entries = data["choices"][0]["logprobs"]["content"]
    assert entries and all(len(e["top_logprobs"]) == 5 for e in entries)
    jsonschema.validate(json.loads(data["choices"][0]["message"]["content"]), COLOR)


async def test_tool_choice_required_yields_a_parsed_tool_call(served: Any) -> None:
    client, _ = served
    for seed in range(3):
        data = await answer(client, seed=seed, tools=TOOLS, tool_choice="required")
        choice = data["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] in ("weather", "time")
        schema = next(t["function"]["parameters"] for t in TOOLS
                      if t["function"]["name"] == call["function"]["name"])
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


async def test_a_named_tool_choice_calls_that_tool(served: Any) -> None:
    client, _ = served
    named = {"type": "function", "function": {"name": "weather"}}
    for seed in range(3):
        data = await answer(client, seed=seed, tools=TOOLS, tool_choice=named)
        (call,) = data["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_ARGS)


async def test_a_forced_tool_call_streams_as_tool_call_deltas(served: Any) -> None:
    client, _ = served
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 120, "seed": 2,
            "stream": True, "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "time"}}}
    calls, finish = [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                calls += choice["delta"].get("tool_calls", [])
                finish = choice["finish_reason"] or finish
    assert finish == "tool_calls"
    assert calls[0]["function"]["name"] == "time"
    args = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(args)["zone"] in ("UTC", "CET")


@pytest.mark.parametrize(("extra", "param", "code"), [
    ({"response_format": schema_format({"type": "nonsense"})},
     "response_format", "invalid_json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1, 2]}}},
     "response_format", "invalid_json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "invalid_response_format"),
    ({"response_format": "json"}, "response_format", "invalid_response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "invalid_tool_choice"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "invalid_tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "wrong"}}}}}], "tool_choice": "required"},
     "tool_choice", "invalid_tool_schema"),
])
async def test_what_cannot_be_enforced_is_a_400_with_a_code(
        served: Any, extra: dict[str, Any], param: str, code: str) -> None:
    client, _ = served
    r = await chat(client, **extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == code
    assert error["type"] == "invalid_request_error" and error["message"]


async def test_auto_and_none_constrain_nothing(served: Any) -> None:
    client, _ = served
    for choice in ("auto", "none"):
        data = await answer(client, seed=0, tools=TOOLS, tool_choice=choice, max_tokens=30)
        message = data["choices"][0]["message"]
        assert "tool_calls" not in message  # the random model writes no call by itself
        assert "<tool_call>" not in message["content"]  # nor was one forced on it
        with pytest.raises(ValueError):
            json.loads(message["content"])


async def test_without_a_compiler_a_constraint_is_refused_not_ignored(
        model: Any, tokenizer: Any) -> None:
    gen = BatchGenerator(model, tokenizer)
    gen.start()
    app = build_app("tiny", gen, chat_ids(tokenizer), chat_ids(tokenizer))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://tiny") as client:
            r = await chat(client, response_format={"type": "json_object"})
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "unsupported_constraint"
    finally:
        gen.stop()
