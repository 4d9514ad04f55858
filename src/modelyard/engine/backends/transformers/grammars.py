"""What a request constrains its output to, as an llguidance Lark grammar (pure: no torch, no
llguidance; `constraints.py` compiles the text).

- `response_format: {"type": "json_object"}` → any JSON object;
  `{"type": "json_schema", "json_schema": {"schema": S}}` → JSON valid against S (no `schema`:
  any JSON object, as OpenAI's spec leaves it optional); `{"type": "text"}` → nothing.
- `tool_choice: "required"` → one call of one of the offered tools; a named function
  (`{"type": "function", "function": {"name": N}}`) → one call of N. The call is spelled the way
  `tool_calls.parse` reads the model family's format (hermes when the chat template teaches
  none), its arguments constrained by the function's `parameters` schema. `"auto"` and `"none"`
  constrain nothing (`"none"` also keeps the tools out of the prompt: loader.py). A forced tool
  call wins over `response_format`.

Exactly one call is forced: a grammar allowing several would let a small model repeat calls up to
`max_tokens`. Literal markers (`<tool_call>`, `[TOOL_CALLS]`) are matched as text, which is what
the parser reads; llama3's `<|python_tag|>` (a special token) is left out, as the parser takes
a bare JSON object too.

A request the grammar cannot be built from raises `InvalidGrammar` (a 400 with `code`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from modelyard.engine.backends.transformers.params import InvalidParams
from modelyard.engine.backends.transformers.tool_calls import Family

ANY_OBJECT: dict[str, Any] = {"type": "object"}
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": "}


class InvalidGrammar(InvalidParams):
    """A response_format or tool_choice that cannot be enforced; `code` is the error's code."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(message, param)
        self.code = code


@dataclass(frozen=True)
class Grammar:
    lark: str  # llguidance's Lark dialect (`%json` embeds a JSON schema)
    param: str  # the request field it comes from, for errors found when compiling it
    code: str


def tool_choice_forced(body: dict[str, Any]) -> bool:
    choice = body.get("tool_choice")
    return choice == "required" or isinstance(choice, dict)


def parse_family(body: dict[str, Any], template_family: Family | None) -> Family | None:
    """The family whose tool calls the answer is parsed for: the template's, or hermes when a
    call is forced on a model whose template teaches no format."""
    if template_family is None and tool_choice_forced(body) and body.get("tools"):
        return "hermes"
    return template_family


def request_grammar(body: dict[str, Any], chat: bool,
                    template_family: Family | None) -> Grammar | None:
    """The grammar `body` asks for, or None when it constrains nothing."""
    if chat:
        tools = _forced_tools(body)
        if tools is not None:
            family = template_family or "hermes"
            return Grammar(_tool_call_lark(tools, family), "tool_choice", "invalid_tool_schema")
    schema = _response_schema(body.get("response_format"))
    if schema is None:
        return None
    return Grammar(_lark_rule("start", [_json(schema)]), "response_format", "invalid_json_schema")


def _response_schema(fmt: Any) -> dict[str, Any] | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidGrammar("response_format must be an object", "response_format",
                             "invalid_response_format")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind != "json_schema":
        raise InvalidGrammar(f"response_format.type must be 'text', 'json_object' or "
                             f"'json_schema', not {kind!r}", "response_format",
                             "invalid_response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidGrammar("response_format.json_schema must be an object with a `schema`",
                             "response_format", "invalid_json_schema")
    schema = spec.get("schema")
    if schema is None:
        return ANY_OBJECT
    if not isinstance(schema, dict):
        raise InvalidGrammar("response_format.json_schema.schema must be a JSON schema object",
                             "response_format", "invalid_json_schema")
    return schema


def _forced_tools(body: dict[str, Any]) -> list[tuple[str, Any]] | None:
    """(name, parameters schema) of the tools one of which must be called; None when the
    request forces no call."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return None
    if choice != "required" and not isinstance(choice, dict):
        raise InvalidGrammar("tool_choice must be 'none', 'auto', 'required' or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                             "tool_choice", "invalid_tool_choice")
    tools = _tools(body.get("tools"))
    if not tools:
        raise InvalidGrammar("tool_choice forces a tool call but no tools are given",
                             "tool_choice", "invalid_tool_choice")
    if choice == "required":
        return tools
    assert isinstance(choice, dict)
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidGrammar("tool_choice.function.name must be a string", "tool_choice",
                             "invalid_tool_choice")
    named = [t for t in tools if t[0] == name]
    if not named:
        raise InvalidGrammar(f"tool_choice names '{name}', which is not among the tools",
                             "tool_choice", "invalid_tool_choice")
    return named


def _tools(value: Any) -> list[tuple[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidGrammar("tools must be a list", "tools", "invalid_tools")
    out = []
    for tool in value:
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidGrammar("each tool needs a function with a name", "tools",
                                 "invalid_tools")
        assert isinstance(fn, dict)
        params = fn.get("parameters")
        if params is None or params == {}:
            params = ANY_OBJECT
        if not isinstance(params, dict):
            raise InvalidGrammar(f"the parameters of tool '{name}' must be a JSON schema",
                                 "tools", "invalid_tool_schema")
        out.append((name, params))
    return out


def _tool_call_lark(tools: list[tuple[str, Any]], family: Family) -> str:
    key = "parameters" if family == "llama3" else "arguments"
    calls = [{"type": "object",
              "properties": {"name": {"const": name}, key: params},
              "required": ["name", key], "additionalProperties": False}
             for name, params in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if family == "hermes":
        parts = [_str("<tool_call>\n"), "call", _str("\n</tool_call>")]
    elif family == "mistral":
        parts = [_str("[TOOL_CALLS]["), "call", _str("]")]
    else:
        parts = ["call"]
    return _lark_rule("start", parts) + _lark_rule("call", [_json(schema)])


def _lark_rule(name: str, parts: list[str]) -> str:
    return f"{name}: {' '.join(parts)}\n"


def _json(schema: dict[str, Any]) -> str:
    # Fixed whitespace (json.dumps' separators): llguidance's default lets any amount of
    # whitespace between tokens, where a small model can spend its whole max_tokens.
    # A schema's own `x-guidance` options win.
    own = schema.get("x-guidance")
    options = {**JSON_OPTIONS, **(own if isinstance(own, dict) else {})}
    return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


def _str(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid Lark string literal
