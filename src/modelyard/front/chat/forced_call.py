"""A forced tool call (`tool_choice` "required" or a named function) on llama-server, enforced.

llama-server's own grammar for a required call (its Hermes format's) admits free text before the
call, so a small model can talk until `max_tokens` and never call at all. What llama-server does
enforce exactly is a JSON schema, so the front asks for that: the tools stay in the request (the
chat template still shows them to the model), `tool_choice` becomes "none" (no grammar of its
own), and `response_format` admits exactly one call, `{"name": an allowed function, "arguments":
that function's parameters}`. The answer's JSON is turned back into the `tool_calls` OpenAI
documents (`finish_reason: "tool_calls"`), whole or streamed: the text is held until the call is
complete, then sent as one delta, which every API's renderer reads like a backend's own call.

The transformers engine enforces forced calls itself (its grammars.py); this is for llama-server.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ForcedCall:
    """One answer's forced call: the functions it may name, and the text held per choice."""

    names: frozenset[str]
    call_id: str = field(default_factory=lambda: "call_" + os.urandom(12).hex())
    _held: dict[int, str] = field(default_factory=dict)

    def whole(self, data: dict[str, Any]) -> dict[str, Any]:
        """A whole chat completion: its message's JSON text as the call."""
        for choice in data.get("choices") or []:
            message = choice.get("message") if isinstance(choice, dict) else None
            if not isinstance(message, dict) or message.get("tool_calls"):
                continue
            call = self._call(str(message.get("content") or ""), int(choice.get("index") or 0))
            if call is not None:
                message["content"] = None
                message["tool_calls"] = [call]
                choice["finish_reason"] = "tool_calls"
        return data

    def events(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """One streamed chunk → the chunks to send: text is held; at the finish, the call."""
        choices = event.get("choices")
        if not isinstance(choices, list) or not choices:
            return [event]
        out: list[dict[str, Any]] = []
        kept = []
        for choice in choices:
            if not isinstance(choice, dict):
                kept.append(choice)
                continue
            index = int(choice.get("index") or 0)
            delta = choice.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                self._held[index] = self._held.get(index, "") + delta["content"]
                delta = {k: v for k, v in delta.items() if k != "content"}
                choice = {**choice, "delta": delta}
            if choice.get("finish_reason") is None:
                if delta:  # the role, a reasoning delta: they pass
                    kept.append(choice)
                continue
            held = self._held.pop(index, "")
            call = self._call(held, index)
            if call is None:  # cut short (max_tokens) or not a call: the text, as it came
                kept.append({**choice, "delta": {**(delta or {}), "content": held}})
                continue
            head = {k: v for k, v in event.items() if k not in ("usage", "timings")}
            out.append({**head, "choices": [{
                "index": index, "finish_reason": None,
                "delta": {"role": "assistant", "content": None,
                          "tool_calls": [{"index": 0, **call}]}}]})
            kept.append({**choice, "delta": {}, "finish_reason": "tool_calls"})
        if kept or event.get("usage") is not None:
            out.append({**event, "choices": kept})
        return out

    def _call(self, text: str, index: int) -> dict[str, Any] | None:
        try:
            data = json.loads(text)
        except ValueError:
            return None
        if not isinstance(data, dict) or data.get("name") not in self.names:
            return None
        arguments = data.get("arguments")
        if not isinstance(arguments, dict):
            return None
        # each choice's call its own id (several choices: `n`)
        call_id = self.call_id if index == 0 else f"{self.call_id}_{index}"
        return {"id": call_id, "type": "function",
                "function": {"name": data["name"], "arguments": json.dumps(arguments)}}


def plan(payload: dict[str, Any]) -> tuple[dict[str, Any], ForcedCall] | None:
    """The request that enforces `payload`'s forced call through a JSON schema, and the
    answer's conversion; None when it forces nothing (or names a function it does not offer:
    the API's own validation reports that)."""
    choice = payload.get("tool_choice")
    tools = payload.get("tools")
    if not isinstance(tools, list) or not (choice == "required" or isinstance(choice, dict)):
        return None
    functions = [t["function"] for t in tools if isinstance(t, dict)
                 and isinstance(t.get("function"), dict)
                 and isinstance(t["function"].get("name"), str)]  # fmt: skip
    if isinstance(choice, dict):
        named = choice.get("function")
        name = named.get("name") if isinstance(named, dict) else None
        functions = [f for f in functions if f["name"] == name]
    if not functions:
        return None
    shapes = [_call_schema(f) for f in functions]
    schema = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
    forced = {k: v for k, v in payload.items() if k != "parallel_tool_calls"}
    forced.update(tool_choice="none", response_format={
        "type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}})
    return forced, ForcedCall(frozenset(f["name"] for f in functions))


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        parameters = {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": parameters},
            "required": ["name", "arguments"]}
