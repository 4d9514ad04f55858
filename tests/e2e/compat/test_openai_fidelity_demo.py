"""End to end: OpenAI fidelity (front/chat/openai_compat.py) on the real llama-server and demo
model: `tool_choice` required and named are enforced (the official SDK and LangChain's ChatOpenAI
`bind_tools(tool_choice=...)` / `with_structured_output(method="function_calling")`), and a
context overflow is OpenAI's `context_length_exceeded`, which LangChain and litellm recognise.

One modelyard server (one llama-server, a small context so an overflow is cheap) per module.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel
from tests.e2e.compat.table import covers
from tests.support import Server, require_e2e_artifact

from modelyard.config import DEMO_MODEL_FILE, Settings, cache_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CTX = 512


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_e2e_artifact(Settings().resolve_llama_server(), "llama-server")
    gguf = require_e2e_artifact(cache_dir() / "models" / DEMO_MODEL_FILE, "the demo model")
    home = tmp_path_factory.mktemp("e2e-fidelity")
    (home / "models").mkdir()
    (home / "models" / DEMO_MODEL_FILE).symlink_to(gguf)
    srv = Server(home, {"scan_hf_cache": False, "default_ctx_size": CTX,
                        "llama_server_parallel": 1})
    try:
        srv.wait_healthy(90)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=240,
                         max_retries=0)


def number_tool(name: str, verb: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": f"{verb} two numbers.",
        "parameters": {"type": "object", "required": ["a", "b"],
                       "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}


ADD, MULTIPLY = number_tool("add", "Add"), number_tool("multiply", "Multiply")


def add_call(a: int, b: int) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{a}_{b}", "type": "function",
         "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}]}


# Earlier `add` calls in the history: the 135M demo model imitates them (as in test_demo_model).
HISTORY = [{"role": "user", "content": "add 1 and 1"}, add_call(1, 1),
           {"role": "user", "content": "add 4 and 5"}, add_call(4, 5),
           {"role": "user", "content": "add 2 and 3"}]


def numeric_args(arguments: dict[str, Any]) -> bool:
    return set(arguments) == {"a", "b"} and all(
        isinstance(v, int | float) for v in arguments.values())


def test_a_named_tool_choice_is_enforced(oai: openai.OpenAI) -> None:
    """The history shows `add`; naming `multiply` must yield a multiply call (before, the
    object form was ignored by llama-server and the model called `add`)."""
    done = oai.chat.completions.create(
        model="smollm2", messages=HISTORY, tools=[ADD, MULTIPLY],  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "multiply"}},
        max_tokens=48, temperature=0)
    calls = done.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["multiply"], done.choices[0]
    assert numeric_args(json.loads(calls[0].function.arguments))


def test_langchain_bind_tools_with_a_named_choice(server: Server) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused",  # type: ignore[arg-type]
                     model="smollm2", temperature=0, max_tokens=48, timeout=240, max_retries=0)
    answer = llm.bind_tools([ADD, MULTIPLY], tool_choice="multiply").invoke(HISTORY)
    assert [c["name"] for c in answer.tool_calls] == ["multiply"], answer  # type: ignore[attr-defined]
    assert numeric_args(answer.tool_calls[0]["args"])  # type: ignore[attr-defined]


class Multiply(BaseModel):
    """Multiply two numbers."""

    a: float
    b: float


def test_langchain_structured_output_by_function_calling(server: Server) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused",  # type: ignore[arg-type]
                     model="smollm2", temperature=0, max_tokens=48, timeout=240, max_retries=0)
    structured = llm.with_structured_output(Multiply, method="function_calling")
    result = structured.invoke(HISTORY)
    assert isinstance(result, Multiply)


LONG = "hello " * (CTX + 100)


def test_context_overflow_is_context_length_exceeded(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="smollm2", max_tokens=4,
                                    messages=[{"role": "user", "content": LONG}])
    assert info.value.code == "context_length_exceeded"
    assert f"maximum context length is {CTX} tokens" in info.value.message


def test_langchain_and_litellm_recognise_the_overflow(server: Server) -> None:
    import litellm
    from langchain_core.exceptions import ContextOverflowError
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused",  # type: ignore[arg-type]
                     model="smollm2", max_tokens=4, timeout=240, max_retries=0)
    with pytest.raises(ContextOverflowError):
        llm.invoke(LONG)
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model="openai/smollm2", api_base=server.url + "/v1",
                           api_key="unused", max_tokens=4, num_retries=0,
                           messages=[{"role": "user", "content": LONG}])


@covers("Context overflow is recognisable", "Ollama")
def test_ollama_api_overflow_has_its_shape(server: Server) -> None:
    # A last message longer than the context: the one overflow Ollama's cut cannot mend.
    r = httpx.post(server.url + "/api/chat", timeout=240, json={
        "model": "smollm2", "messages": [{"role": "user", "content": LONG}], "stream": False,
        "options": {"num_predict": 4}})
    assert r.status_code == 400, r.text
    assert f"maximum context length is {CTX} tokens" in r.json()["error"]
