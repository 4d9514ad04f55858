"""LangChain's ChatOpenAI and ChatOllama, unchanged, against modelyard."""

from __future__ import annotations

import pytest
from langchain_core.exceptions import ContextOverflowError
from langchain_core.tools import tool
from langchain_ollama import ChatOllama
from langchain_openai import ChatOpenAI
from pydantic import BaseModel
from tests.e2e.compat.table import covers
from tests.support import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


class Colour(BaseModel):
    """A colour of the rainbow."""

    name: str
    position: int


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "Sunny"


@pytest.fixture(scope="module")
def chat_openai(compat_server: Server) -> ChatOpenAI:
    return ChatOpenAI(model="smollm2", base_url=compat_server.url + "/v1", api_key="unused",
                      max_tokens=80, temperature=0, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def chat_ollama(compat_server: Server) -> ChatOllama:
    return ChatOllama(model="smollm2", base_url=compat_server.url, validate_model_on_init=True,
                      num_predict=80, temperature=0)


@covers("LangChain ChatOpenAI / ChatOllama", "OpenAI", "Ollama")
def test_invoke_and_stream(chat_openai: ChatOpenAI, chat_ollama: ChatOllama) -> None:
    for model in (chat_openai, chat_ollama):
        answer = model.invoke("Name one colour of the rainbow.")
        assert answer.content
        assert answer.usage_metadata is not None and answer.usage_metadata["input_tokens"] > 5
        assert "".join(str(c.content) for c in model.stream("Say hello."))


@covers("Tools: tool_choice required and named", "OpenAI")
def test_bind_tools_with_tool_choice(chat_openai: ChatOpenAI) -> None:
    # (ChatOllama drops tool_choice: Ollama's API has none.)
    for choice in ("get_weather", "any"):
        bound = chat_openai.bind_tools([get_weather], tool_choice=choice)
        answer = bound.invoke("Tell me a joke.")
        assert answer.tool_calls and answer.tool_calls[0]["name"] == "get_weather"


@covers("Structured output (JSON schema)", "OpenAI", "Ollama")
def test_structured_output_both_methods(chat_openai: ChatOpenAI,
                                        chat_ollama: ChatOllama) -> None:
    for method in ("function_calling", "json_schema"):
        result = chat_openai.with_structured_output(Colour, method=method).invoke(
            "Give the third colour of the rainbow.")
        assert isinstance(result, Colour)
    result = chat_ollama.with_structured_output(Colour, method="json_schema").invoke(
        "Give the third colour of the rainbow.")
    assert isinstance(result, Colour)


@covers("Context overflow is recognisable", "OpenAI")
def test_context_overflow_is_recognised(chat_openai: ChatOpenAI) -> None:
    with pytest.raises(ContextOverflowError):
        chat_openai.invoke("word " * 5000)
