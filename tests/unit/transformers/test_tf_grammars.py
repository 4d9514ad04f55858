"""The grammars a request asks for (grammars.py): what constrains nothing, and, per tool-call
family, that the text the forced-call grammar accepts is text `tool_calls.parse` reads as that
call (and that it refuses a call of another function)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from modelyard.engine.backends.transformers import tool_calls
from modelyard.engine.backends.transformers.constraints import Compiler
from modelyard.engine.backends.transformers.grammars import (
    parse_family,
    request_grammar,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

ARGS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": ARGS}},
         {"type": "function", "function": {"name": "clock"}}]


@pytest.mark.parametrize("body", [
    {}, {"response_format": {"type": "text"}}, {"tools": TOOLS}, {"tools": TOOLS,
                                                                  "tool_choice": "auto"},
    {"tools": TOOLS, "tool_choice": "none"},
])
def test_these_constrain_nothing(body: dict[str, Any]) -> None:
    assert request_grammar(body, True, "hermes") is None


def test_a_forced_call_wins_over_response_format_and_completions_ignore_tools() -> None:
    body = {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}
    chat = request_grammar(body, True, None)
    assert chat is not None and chat.param == "tool_choice" and "<tool_call>" in chat.lark
    plain = request_grammar(body, False, None)
    assert plain is not None and plain.param == "response_format"


def test_parse_family_falls_back_to_hermes_only_when_a_call_is_forced() -> None:
    assert parse_family({"tools": TOOLS, "tool_choice": "required"}, None) == "hermes"
    assert parse_family({"tools": TOOLS}, None) is None
    assert parse_family({"tools": TOOLS, "tool_choice": "required"}, "llama3") == "llama3"


def test_a_schemas_own_x_guidance_wins() -> None:
    schema = {"type": "object", "x-guidance": {"whitespace_flexible": True}}
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    grammar = request_grammar({"response_format": fmt}, True, None)
    assert grammar is not None
    assert '"whitespace_flexible": true' in grammar.lark
    assert '"key_separator": ": "' in grammar.lark


CALLS: dict[tool_calls.Family, tuple[str, str]] = {
    "hermes": ('<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
               '<tool_call>\n{"name": "other", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    "llama3": ('{"name": "weather", "parameters": {"city": "Oslo"}}',
               '{"name": "weather", "arguments": {"city": "Oslo"}}'),
    "mistral": ('[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Oslo"}}]',
                '[TOOL_CALLS][{"name": "weather", "arguments": {"town": "Oslo"}}]'),
}


@pytest.mark.parametrize("family", list(CALLS))
def test_the_forced_call_grammar_accepts_what_the_parser_reads(
        family: tool_calls.Family, tokenizer: Any) -> None:
    compiler = Compiler(tokenizer, [tokenizer.eos_token_id])
    body = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "weather"}}}
    good, bad = CALLS[family]
    grammar = request_grammar(body, True, family)
    assert grammar is not None
    accepted = compiler.compile(grammar)
    for token in tokenizer.encode(good):
        accepted.advance(token)
    assert accepted.finished  # complete: nothing more is admitted
    _, calls = tool_calls.parse(good, family)
    assert [(c.name, c.arguments) for c in calls] == [("weather", '{"city": "Oslo"}')]
    refused = compiler.compile(grammar)
    allowed_all = True
    for token in tokenizer.encode(bad):
        allowed_all &= bool(refused.allowed(len(tokenizer), torch.device("cpu"))[token])
        refused.advance(token)
    assert not allowed_all

