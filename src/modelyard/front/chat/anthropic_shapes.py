"""Anthropic's Messages API in the OpenAI shape the backends serve, and back.

`to_openai` turns a validated /v1/messages (or /v1/messages/count_tokens) body into an OpenAI
chat body: the system prompt becomes a system message, content blocks become OpenAI parts
(an image block becomes an `image_url` data URL), `tool_use` blocks an assistant's `tool_calls`,
`tool_result` blocks `tool` messages, and the tools and tool choice their OpenAI equivalents.
The answer goes the other way in front/chat/render_anthropic.py; errors take Anthropic's shape
here (`error_body`), on every path under /v1/messages (front/render.py picks it by path).

Plain functions over the parsed JSON, as front/chat/shapes.py: an error names the field as the
client wrote it (`messages.1.content.0.source`), a 400 `invalid_request_error` before anything
is leased or loaded.
"""

from __future__ import annotations

import json
from typing import Any

from modelyard.errors import InvalidRequest, ModelyardError, ToolTypeUnsupported

# Every path of the Anthropic API family (errors in its shape, front/render.py).
PATH_PREFIX = "/v1/messages"

# Anthropic's error `type` by HTTP status; a status not listed is a client's mistake (4xx) or
# the server's (5xx). 503 is what Anthropic calls overloaded (its 529): the SDK retries both.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error_body(exc: ModelyardError) -> dict[str, Any]:
    """Anthropic's error envelope for a modelyard error (its status decides the type)."""
    return message_error(exc.status, exc.full_message())


def message_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


# ---- the request --------------------------------------------------------------------------------

# Anthropic's tool_choice types → OpenAI's (a named tool is built below).
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _bad(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param=param)


def _text_of(value: Any, param: str) -> str:
    """`system`, or a tool result's content: a string or a list of text blocks."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(param, "must be a string or a list of text blocks")
    texts = []
    for k, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(
                block.get("text"), str):
            raise _bad(f"{param}.{k}", "must be a text block {\"type\": \"text\", \"text\": …}")
        texts.append(block["text"])
    return "\n".join(texts)


def image_part(block: dict[str, Any], param: str) -> dict[str, Any]:
    """An image block as an OpenAI `image_url` part: base64 → a data URL, url → the URL."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad(f"{param}.source", "an image block needs a `source` object")
    kind = source.get("type")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not media.startswith("image/"):
            raise _bad(f"{param}.source.media_type", "must be an image type (image/png, …)")
        if not isinstance(data, str) or not data:
            raise _bad(f"{param}.source.data", "must be the image's base64 bytes")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise _bad(f"{param}.source.url", "must be the image's URL")
        return {"type": "image_url", "image_url": {"url": url}}
    raise _bad(f"{param}.source.type", "must be base64 or url (a file id needs Anthropic's "
                                       "Files API, which modelyard does not have)")


def _tool_result(block: dict[str, Any], param: str) -> tuple[dict[str, Any],
                                                             list[dict[str, Any]]]:
    """A tool_result block: the OpenAI `tool` message, and the images it carried (OpenAI tool
    messages hold text only: they follow in the user message)."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{param}.tool_use_id", "a tool_result needs the `tool_use_id` it answers")
    content = block.get("content", "")
    images: list[dict[str, Any]] = []
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                images.append(image_part(part, f"{param}.content.{k}"))
            elif kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise _bad(f"{param}.content.{k}", "tool result content: text or image blocks")
        text = "\n".join(texts)
    elif isinstance(content, str):
        text = content
    else:
        raise _bad(f"{param}.content", "must be a string or a list of blocks")
    if block.get("is_error"):
        # OpenAI's tool message has no error flag: the model reads it in the text.
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}, images


def _joined(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text parts only → one string (every chat template reads it); else the parts."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _message(message: dict[str, Any], i: int) -> list[dict[str, Any]]:
    """One Anthropic message as the OpenAI messages it becomes."""
    role, content, param = message["role"], message["content"], f"messages.{i}.content"
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    parts: list[dict[str, Any]] = []
    tool_messages: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for k, block in enumerate(content):
        where = f"{param}.{k}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise _bad(f"{where}.text", "a text block needs `text`, a string")
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(image_part(block, where))
        elif kind == "tool_use" and role == "assistant":
            name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not name or not isinstance(call_id, str):
                raise _bad(where, "a tool_use block needs `id` and `name`")
            if not isinstance(args, dict):
                raise _bad(f"{where}.input", "must be an object")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args)}})
        elif kind == "tool_result" and role == "user":
            tool_message, images = _tool_result(block, where)
            tool_messages.append(tool_message)
            parts.extend(images)
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # an earlier turn's reasoning: not part of the conversation's text
        else:
            raise _bad(where, f"unsupported content block {kind!r} in a {role} message "
                              "(text, image; tool_use from the assistant, tool_result from the "
                              "user)")
    out: list[dict[str, Any]] = list(tool_messages)  # they answer the previous assistant turn
    if calls:
        # "" rather than null: some chat templates cannot render a null content.
        out.append({"role": "assistant", "content": _joined(parts) if parts else "",
                    "tool_calls": calls})
    elif parts or not tool_messages:
        out.append({"role": role, "content": _joined(parts) if parts else ""})
    return out


def _tools(tools: list[Any]) -> list[dict[str, Any]]:
    out = []
    for n, tool in enumerate(tools):
        where = f"tools.{n}"
        if not isinstance(tool, dict):
            raise _bad(where, "a tool must be an object {\"name\", \"input_schema\"}")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise ToolTypeUnsupported(
                f"{where}.type: server tool {str(kind)[:64]!r} is Anthropic's own; modelyard "
                "offers client tools (name, description, input_schema)", param=f"{where}.type")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}.name", "a tool needs a `name`")
        if not isinstance(schema, dict):
            raise _bad(f"{where}.input_schema", "must be a JSON schema object")
        fn: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any], payload: dict[str, Any]) -> None:
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str) or not choice["name"]:
            raise _bad("tool_choice.name", "{\"type\": \"tool\"} needs the tool's `name`")
        payload["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in _TOOL_CHOICES:
        payload["tool_choice"] = _TOOL_CHOICES[kind]
    else:
        raise _bad("tool_choice.type", "must be auto, any, tool or none")
    if choice.get("disable_parallel_tool_use") and kind != "none":
        payload["parallel_tool_calls"] = False


def check_thinking(thinking: dict[str, Any] | None, max_tokens: int | None) -> None:
    """`thinking` as Anthropic validates it: enabled with 1024 ≤ budget_tokens < max_tokens,
    or disabled, adaptive, between_tools. It is accepted and not passed on: see docs/api.md
    (Anthropic Messages)."""
    if thinking is None:
        return
    kind = thinking.get("type")
    if kind in ("disabled", "adaptive", "between_tools"):
        return
    if kind != "enabled":
        raise _bad("thinking.type", "must be enabled, disabled, adaptive or between_tools")
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
        raise _bad("thinking.budget_tokens", "must be an integer ≥ 1024")
    if max_tokens is not None and budget >= max_tokens:
        raise _bad("thinking.budget_tokens", "must be less than max_tokens")


def to_openai(data: dict[str, Any], *, max_tokens: int, stream: bool) -> dict[str, Any]:
    """The OpenAI chat body for a validated Anthropic body (route models have checked the
    types of `messages`, `system`, `tools`, …: here each block's shape is checked)."""
    messages: list[dict[str, Any]] = []
    if data.get("system") is not None:
        messages.append({"role": "system", "content": _text_of(data["system"], "system")})
    for i, message in enumerate(data["messages"]):
        messages.extend(_message(message, i))
    payload: dict[str, Any] = {"model": data["model"], "messages": messages,
                               "max_tokens": max_tokens, "stream": stream}
    if stream:  # the token counts come in the last chunk
        payload["stream_options"] = {"include_usage": True}
    if data.get("stop_sequences"):
        payload["stop"] = data["stop_sequences"]
    for name in ("temperature", "top_p", "top_k"):
        if data.get(name) is not None:
            payload[name] = data[name]
    if data.get("tools"):
        payload["tools"] = _tools(data["tools"])
    if data.get("tool_choice") is not None:
        _tool_choice(data["tool_choice"], payload)
    _output_format(data.get("output_config"), payload)
    return payload


def _output_format(config: Any, payload: dict[str, Any]) -> None:
    """`output_config.format` (structured outputs: a JSON schema the answer must match) →
    OpenAI's `response_format`; `effort` has no backend equivalent and is ignored."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise _bad("output_config", "must be an object")
    fmt = config.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(
            fmt.get("schema"), dict):
        raise _bad("output_config.format", "must be {\"type\": \"json_schema\", \"schema\": "
                                           "{…}}")
    payload["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "output", "schema": fmt["schema"]}}
