"""OpenAI's legacy function calling: `functions` and `function_call` (before `tools`).

OpenAI still accepts them, and older agents send them; llama-server reads only `tools`, so
without this a request with `functions` gets prose back and no error. The request is mapped to
tools — `functions` to function tools, `function_call` ("none", "auto", {"name"}) to
`tool_choice`, history in the legacy shape (an assistant's `function_call`, a `function`
message with the function's result) to tool calls and tool results — and, when the request
offered `functions`, the answer is mapped back: the (first) call becomes `message.function_call`
(`delta.function_call` streamed) with `finish_reason: "function_call"`, and no `tool_calls`.
"""

from __future__ import annotations

from typing import Any

from modelyard.errors import InvalidRequest


def used(data: dict[str, Any]) -> bool:
    """Whether an OpenAI chat body offers functions the legacy way (its messages are looked at by
    front/chat/shapes.py's `check_roles`, which goes over them anyway)."""
    return "functions" in data or "function_call" in data


def to_tools(data: dict[str, Any]) -> dict[str, Any]:
    """The body with the legacy fields as tools (the answer is mapped back when it offered
    `functions`: `answers_legacy`)."""
    out = {k: v for k, v in data.items() if k not in ("functions", "function_call")}
    functions = data.get("functions")
    if functions is not None:
        if "tools" in data:
            raise InvalidRequest("functions: send `tools` or the legacy `functions`, not both",
                                 param="functions")
        if not isinstance(functions, list):
            raise InvalidRequest("functions: must be a list of functions ({\"name\", "
                                 "\"parameters\"})", param="functions")
        out["tools"] = [{"type": "function", "function": f} for f in functions]
    choice = data.get("function_call")
    if choice is not None and "tool_choice" not in data:
        out["tool_choice"] = _tool_choice(choice)
    if isinstance(data.get("messages"), list):
        out["messages"] = _messages(data["messages"])
    return out


def answers_legacy(data: dict[str, Any]) -> bool:
    """Whether the answer goes back in the legacy shape: the request offered `functions`."""
    return data.get("functions") is not None


def _tool_choice(choice: Any) -> Any:
    if choice in ("none", "auto"):
        return choice
    name = choice.get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidRequest("function_call: \"none\", \"auto\" or {\"name\": …}",
                             param="function_call")
    return {"type": "function", "function": {"name": name}}


def _messages(messages: list[Any]) -> list[Any]:
    """An assistant's `function_call` as one tool call with an id; a `function` message as the
    `tool` result of the last call of that name (OpenAI's legacy shape has no ids)."""
    out: list[Any] = []
    pending: dict[str, str] = {}  # function name → the id given to its last call
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            out.append(message)
            continue
        call = message.get("function_call")
        if isinstance(call, dict):
            call_id = f"call_{i}"
            name = str(call.get("name") or "")
            pending[name] = call_id
            arguments = call.get("arguments")
            message = {k: v for k, v in message.items() if k != "function_call"}
            message["tool_calls"] = [{"id": call_id, "type": "function", "function": {
                "name": name, "arguments": arguments if isinstance(arguments, str) else "{}"}}]
            message.setdefault("content", None)
        elif message.get("role") == "function":
            name = str(message.get("name") or "")
            message = {"role": "tool", "tool_call_id": pending.pop(name, f"call_{i}"),
                       "name": name, "content": message.get("content") or ""}
        out.append(message)
    return out


def answer_choice(choice: dict[str, Any]) -> None:
    """One choice of the answer (whole or a streamed chunk's), in place: its tool call as
    `function_call`."""
    for key in ("message", "delta"):
        part = choice.get(key)
        if isinstance(part, dict) and "tool_calls" in part:
            calls = part.pop("tool_calls")
            first = [c for c in calls or [] if isinstance(c, dict)
                     and c.get("index", 0) == 0 and isinstance(c.get("function"), dict)]
            if first:
                fn = first[0]["function"]
                part["function_call"] = {k: fn[k] for k in ("name", "arguments") if k in fn}
    if choice.get("finish_reason") == "tool_calls":
        choice["finish_reason"] = "function_call"
