"""Presets: a name for a model plus request defaults (sampling, limits, a system prompt).

What the request says wins; a preset only fills in what it leaves out. Applied to the OpenAI-shaped
body every API sends upstream, so the OpenAI, Ollama and native APIs behave the same.
"""

from __future__ import annotations

from typing import Any

import orjson

from modelyard.config import Preset


def apply_preset(preset: Preset, body: dict[str, Any]) -> dict[str, Any]:
    out = {**preset.parameters, **body}
    messages = body.get("messages")
    if preset.system and isinstance(messages, list):
        has_system = any(isinstance(m, dict) and m.get("role") == "system" for m in messages)
        if not has_system:
            out["messages"] = [{"role": "system", "content": preset.system}, *messages]
    if preset.messages and isinstance(messages, list):
        chat = out["messages"]
        head = 0  # after the leading system message(s)
        while head < len(chat) and isinstance(chat[head], dict) and (
                chat[head].get("role") == "system"):
            head += 1
        out["messages"] = [*chat[:head], *preset.messages, *chat[head:]]
    return out


def apply_preset_bytes(preset: Preset, payload: bytes) -> bytes:
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return payload  # not ours to judge: the backend answers it
    if not isinstance(body, dict):
        return payload
    return orjson.dumps(apply_preset(preset, body))
