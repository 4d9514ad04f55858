"""Issue 32, item 10: what the Anthropic column of docs/compatibility.md claims beyond the SDK's
own round trips: LangChain's ChatAnthropic (invoke, stream, a tool call), the prompt tokens read
from the cache apart (`cache_read_input_tokens`), and an overflow its clients recognise
(litellm's `anthropic/`, ChatAnthropic) — against the demo model, unchanged clients."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from langchain_anthropic import ChatAnthropic
from langchain_core.exceptions import ContextOverflowError
from langchain_core.tools import tool
from tests.e2e.compat.table import covers
from tests.support import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

# Beyond the 2048 tokens of a slot (conftest.py) whatever the tokenizer.
TOO_LONG = "word " * 5000


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "Sunny"


@pytest.fixture(scope="module")
def chat_anthropic(compat_server: Server) -> ChatAnthropic:
    return ChatAnthropic(model="smollm2", base_url=compat_server.url, api_key="unused",
                         max_tokens=80, temperature=0, timeout=120, max_retries=0)


@covers("LangChain ChatOpenAI / ChatOllama", "Anthropic")
def test_chat_anthropic_invoke_stream_and_a_tool_call(chat_anthropic: ChatAnthropic) -> None:
    answer = chat_anthropic.invoke("Name one colour of the rainbow.")
    assert isinstance(answer.content, str) and answer.content
    usage = answer.usage_metadata
    assert usage is not None and usage["input_tokens"] > 5 and usage["output_tokens"] > 0
    assert "".join(str(c.content) for c in chat_anthropic.stream("Say hello."))
    bound = chat_anthropic.bind_tools([get_weather], tool_choice="get_weather")
    called = bound.invoke("What is the weather in Paris?")
    assert called.tool_calls and called.tool_calls[0]["name"] == "get_weather"
    assert str(called.tool_calls[0]["id"]).startswith("toolu_")


@covers("Token usage (all prompt tokens)", "Anthropic")
def test_cache_read_input_tokens(compat_server: Server) -> None:
    claude = anthropic.Anthropic(base_url=compat_server.url, api_key="unused", timeout=120,
                                 max_retries=0)
    system = "You are a terse assistant. " * 20  # a prefix worth caching
    messages: Any = [{"role": "user", "content": "Name a colour."}]
    first = claude.messages.create(model="smollm2", max_tokens=4, system=system,
                                   messages=messages, extra_body={"temperature": 0})
    again = claude.messages.create(model="smollm2", max_tokens=4, system=system,
                                   messages=messages, extra_body={"temperature": 0})
    total = claude.messages.count_tokens(model="smollm2", system=system,
                                         messages=messages).input_tokens
    for msg in (first, again):  # Anthropic's input_tokens leave out the tokens read from cache
        assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == total
    cached = again.usage.cache_read_input_tokens
    assert cached is not None and cached > 100  # the repeated system prompt came from cache
    assert again.usage.input_tokens < total - 100


@pytest.fixture(scope="module")
def litellm() -> Iterator[Any]:
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no network: its bundled map
    import litellm as module

    module.telemetry = False
    yield module


@covers("Context overflow is recognisable", "Anthropic")
def test_overflow_is_recognised_by_litellm_and_langchain(
        litellm: Any, compat_server: Server, chat_anthropic: ChatAnthropic) -> None:
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model="anthropic/smollm2", api_base=compat_server.url,
                           api_key="unused", max_tokens=4, timeout=120,
                           messages=[{"role": "user", "content": TOO_LONG}])
    with pytest.raises(ContextOverflowError):
        chat_anthropic.invoke(TOO_LONG)
    claude = anthropic.Anthropic(base_url=compat_server.url, api_key="unused", timeout=120,
                                 max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="smollm2", max_tokens=4,
                               messages=[{"role": "user", "content": TOO_LONG}])
    message = err.value.body["error"]["message"]  # type: ignore[index]
    assert message.startswith("prompt is too long: ")  # Anthropic's wording
    assert message.endswith(" tokens > 2048 maximum")
