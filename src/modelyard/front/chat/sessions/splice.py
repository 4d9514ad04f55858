"""Where a session turn's messages go: `splice` joins the stored history and a request's messages.

- the request's messages begin with the stored history (the client resent everything): they are
  taken as they are, nothing is duplicated;
- otherwise they are appended to the history, except that leading system messages in the request
  replace the stored leading system messages.
"""

from __future__ import annotations

from typing import Any

import orjson


def _norm_content(content: Any) -> Any:
    return "" if content is None else content


def _args(arguments: Any) -> Any:
    """Tool-call arguments as an object: OpenAI sends a JSON string, Ollama an object."""
    if isinstance(arguments, str):
        try:
            return orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
    return arguments


def _key(message: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two messages the same one for splicing (clients drop or add nulls and ids,
    and Ollama's tool calls carry their arguments as objects)."""
    calls = message.get("tool_calls") or None
    call_key = None
    if isinstance(calls, list):
        fns = [(c.get("function") or {}) if isinstance(c, dict) else c for c in calls]
        call_key = orjson.dumps(
            [(f.get("name"), _args(f.get("arguments"))) if isinstance(f, dict) else f
             for f in fns], option=orjson.OPT_SORT_KEYS)
    return (message.get("role"), orjson.dumps(_norm_content(message.get("content"))),
            call_key)


def leading_system(messages: list[dict[str, Any]]) -> int:
    n = 0
    while n < len(messages) and messages[n].get("role") == "system":
        n += 1
    return n


def splice(history: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation to send: the stored `history` with the request's `new` messages."""
    if len(new) >= len(history) and all(
        _key(h) == _key(n) for h, n in zip(history, new, strict=False)
    ):
        return list(new)  # resent whole (or the history is empty)
    systems = leading_system(new)
    if systems:
        return [*new[:systems], *history[leading_system(history):], *new[systems:]]
    return [*history, *new]
