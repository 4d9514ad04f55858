"""End to end: the official `anthropic` SDK, unchanged, against modelyard serving the real demo
model through the real llama-server: a message, a stream, a tool call, and count_tokens.

One modelyard server (so one llama-server) is shared by the module.
"""

from __future__ import annotations

from typing import Any

import anthropic
import pytest
from tests.support import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PROMPT: list[Any] = [{"role": "user", "content": "Name one colour of the rainbow."}]
GREEDY = {"temperature": 0}  # this SDK has no sampling arguments: sent in the body
ADD = {"name": "add", "description": "Add two numbers.",
       "input_schema": {"type": "object", "required": ["a", "b"],
                        "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}


@pytest.fixture(scope="module")
def server(compat_server: Server) -> Server:
    """The suite's shared server (tests/e2e/compat/conftest.py): the same config as this
    module would start."""
    return compat_server


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=120,
                               max_retries=0)


def test_message_and_count_tokens(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model="smollm2", max_tokens=12, system="Answer briefly.",
                                     messages=PROMPT, extra_body=GREEDY)
    assert message.model == "smollm2" and message.content[0].type == "text"
    assert message.content[0].text.strip()
    assert message.stop_reason in ("end_turn", "max_tokens")
    prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert message.usage.output_tokens > 0 and prompt > 10
    counted = client.messages.count_tokens(model="smollm2", system="Answer briefly.",
                                           messages=PROMPT)
    # The model's own count of the templated prompt: what the answer reported.
    assert counted.input_tokens == prompt


def test_stream(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model="smollm2", max_tokens=12, messages=PROMPT,
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text.strip() and final.content[0].type == "text"
    assert final.content[0].text == text
    assert final.usage.output_tokens > 0


@pytest.mark.timeout(400)  # a tool grammar and a long prompt: slow on a busy CPU
def test_tool_use(client: anthropic.Anthropic) -> None:
    """Two earlier calls in the history: the 135M demo model imitates them at temperature 0
    (as in test_demo_model.py's OpenAI tool call)."""
    def call(a: int, b: int) -> dict[str, Any]:
        return {"role": "assistant", "content": [
            {"type": "tool_use", "id": f"toolu_{a}_{b}", "name": "add",
             "input": {"a": a, "b": b}}]}  # fmt: skip

    messages = [{"role": "user", "content": "add 1 and 1"}, call(1, 1),
                {"role": "user", "content": "add 4 and 5"}, call(4, 5),
                {"role": "user", "content": "add 2 and 3"}]
    message = client.messages.create(model="smollm2", max_tokens=48, tools=[ADD],
                                     messages=messages, extra_body=GREEDY, timeout=380)
    assert message.stop_reason == "tool_use", message
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "add" and uses[0].id
    assert set(uses[0].input) == {"a", "b"}
