"""Tool calls in a model's generated text, by model family, as OpenAI `tool_calls`.

Pure (no torch): the format is picked from the chat template's text, and the parser turns the
whole generated text into (content outside the calls or None, calls). Families:
- hermes (Hermes, Qwen 2/2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
- llama3: a bare JSON object `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;`
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

Family = Literal["hermes", "llama3", "mistral"]

# Where a tool call begins in streamed text, per family (text before it streams as content).
MARKERS: dict[Family, tuple[str, ...]] = {
    "hermes": ("<tool_call>",),
    "llama3": ("<|python_tag|>", "{"),
    "mistral": ("[TOOL_CALLS]",),
}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def openai(self) -> dict[str, Any]:
        return {"id": self.id or new_call_id(), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def family_for(template: str) -> Family | None:
    """The tool-call format a chat template teaches; None when it renders no tools."""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("tools" in template and "parameters" in template
                                        and "<|start_header_id|>" in template):
        return "llama3"
    if "tools" in template:
        return "hermes"  # the most common convention for templates that render tools
    return None


def marker_at(text: str, family: Family) -> int:
    """Index where a tool call begins in `text`, or -1. llama3's bare JSON counts only at the
    start of the answer (after whitespace), as its template asks."""
    best = -1
    for marker in MARKERS[family]:
        if family == "llama3" and marker == "{":
            stripped = text.lstrip()
            pos = len(text) - len(stripped) if stripped.startswith("{") else -1
        else:
            pos = text.find(marker)
        if pos >= 0 and (best < 0 or pos < best):
            best = pos
    return best


def may_become_marker(text: str, family: Family) -> int:
    """Length of a suffix of `text` that could be the start of a marker (hold it back)."""
    longest = 0
    for marker in MARKERS[family]:
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:n]):
                longest = max(longest, n)
                break
    return longest


def _call_from(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        text = args
    else:
        text = json.dumps(args if args is not None else {})
    return ToolCall(name=name, arguments=text, id=str(obj.get("id") or ""))


def _json_values(text: str) -> list[Any]:
    """Consecutive JSON values in `text` (separated by whitespace, `;` or `,`)."""
    decoder = json.JSONDecoder()
    values, pos = [], 0
    while pos < len(text):
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        if pos >= len(text):
            break
        value, pos = decoder.raw_decode(text, pos)
        values.append(value)
    return values


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse(text: str, family: Family) -> tuple[str | None, list[ToolCall]]:
    """(content outside the calls, or None when empty; calls). Text that does not parse as
    calls stays content, so a malformed call is never lost."""
    if family == "hermes":
        calls: list[ToolCall] = []
        rest: list[str] = []
        last = 0
        for m in _HERMES.finditer(text):
            try:
                call = _call_from(json.loads(m.group(1)))
            except ValueError:
                call = None
            if call is None:
                continue
            calls.append(call)
            rest.append(text[last:m.start()])
            last = m.end()
        rest.append(text[last:])
        return _content("".join(rest)) if calls else _content(text), calls
    start = marker_at(text, family)
    if start < 0:
        return _content(text), []
    body = text[start:]
    for marker in MARKERS[family]:
        if marker != "{" and body.startswith(marker):
            body = body[len(marker):]
            break
    try:
        values = _json_values(body)
    except ValueError:
        return _content(text), []
    flat: list[Any] = []
    for v in values:
        flat.extend(v if isinstance(v, list) else [v])
    parsed = [_call_from(v) for v in flat]
    if not parsed or any(c is None for c in parsed):
        return _content(text), []
    return _content(text[:start]), [c for c in parsed if c is not None]


def _content(text: str) -> str | None:
    return text if text.strip() else None


def openai_message(text: str, family: Family | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message for `text`, and "tool_calls" as finish_reason when it has calls."""
    if family is None:
        return {"role": "assistant", "content": text}, None
    content, calls = parse(text, family)
    if not calls:
        return {"role": "assistant", "content": text}, None
    return ({"role": "assistant", "content": content,
             "tool_calls": [c.openai() for c in calls]}, "tool_calls")


def stream_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI streaming deltas for finished calls: per call, one delta with id, type, name and
    empty arguments, then one with the argument text."""
    deltas: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        call_id = call.id or new_call_id()
        deltas.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                       "function": {"name": call.name, "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": index,
                                       "function": {"arguments": call.arguments}}]})
    return deltas


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message as chat templates expect it: tool-call arguments as objects (Qwen,
    Llama and Mistral templates iterate or `tojson` them), not JSON text."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    fixed = []
    for call in calls:
        fn = (call or {}).get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"])
            except ValueError:
                args = fn["arguments"]
            call = {**call, "function": {**fn, "arguments": args}}
        fixed.append(call)
    return {**message, "tool_calls": fixed}


def tool_family_of(tokenizer: Any) -> Family | None:
    """The tool-call format of a loaded tokenizer's chat template(s)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = "\n".join(str(t) for t in template.values())
    return family_for(template) if isinstance(template, str) else None
