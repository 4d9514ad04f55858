"""The shapes of what a chat request carries besides its text: content parts, images, tools.

The OpenAI route relays the client's bytes unchanged, and llama-server answers a malformed part
with a 500 (`"tools": "x"`, an empty or undecodable image, a part without its field): a client
then retries what can never succeed, and the metrics count its mistake as the server's. Checked
here, before anything is leased or loaded, it is a 400 `invalid_request` whose `param` names the
field. Plain functions over the parsed JSON rather than pydantic models: an error then names the
field as the client wrote it (a pydantic union names its branches), and a request without parts
or tools costs a few dict lookups. Unknown part and tool types pass: a backend may know them (an
MCP tool entry is the tool loop's, front/chat/tools/loop.py).
"""

from __future__ import annotations

import binascii
from typing import Any

from modelyard.errors import InvalidRequest, ToolTypeUnsupported

TOOL_CHOICES = ("none", "auto", "required")
# OpenAI's message roles (`function`: the legacy function result, front/chat/legacy_functions.py).
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def check_roles(messages: Any) -> bool:
    """Each message's `role` is OpenAI's: an unknown one would reach the chat template as is,
    pasted into the prompt, so it is a 400 naming it (`messages.N.role`). True when a message
    is in the legacy function-calling shape (a `function` result, an assistant's
    `function_call`: front/chat/legacy_functions.py maps them). One pass, a lookup a message."""
    legacy = False
    for i, message in enumerate(_listed(messages)):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise InvalidRequest(f"messages.{i}.role: unknown role {str(role)[:64]!r}; expected "
                                 f"one of {', '.join(ROLES)}", param=f"messages.{i}.role")
        if role == "function" or (role == "assistant" and "function_call" in message):
            legacy = True
    return legacy


def check_image_data(data: str, param: str) -> None:
    """Base64 image bytes (Ollama's `images` items, a data URL's payload): not empty, decodable."""
    if not data.strip():
        raise InvalidRequest(f"{param}: the image is empty", param=param)
    try:
        decoded = binascii.a2b_base64(data)
    except ValueError as exc:  # binascii.Error, or a non-ASCII character in the string
        raise InvalidRequest(f"{param}: the image is not valid base64 ({exc})",
                             param=param) from None
    if not decoded:
        raise InvalidRequest(f"{param}: the image is not valid base64", param=param)


def check_image_url(url: Any, param: str) -> None:
    """An `image_url.url`: a base64 data URL is checked through; other URLs are the backend's
    to fetch (llama-server takes http(s) ones), but an empty one is nothing to fetch."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidRequest(f"{param}: an image part needs a non-empty `url` (data:image/png;"
                             "base64,… or an http(s) URL)", param=param)
    if url[:5].lower() != "data:":
        return
    head, comma, payload = url.partition(",")
    if not comma or not head.lower().endswith(";base64"):
        raise InvalidRequest(f"{param}: a data URL must be base64: data:image/png;base64,DATA",
                             param=param)
    check_image_data(payload, param)


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _check_part(part: Any, where: str) -> None:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise InvalidRequest(f"{where}: a content part must be an object with a `type` "
                             "(text, image_url)", param=where)
    kind = part["type"]
    if kind == "text" and not isinstance(part.get("text"), str):
        raise InvalidRequest(f"{where}.text: a text part needs `text`, a string",
                             param=f"{where}.text")
    if kind == "image_url":
        image = part.get("image_url")
        if not isinstance(image, dict):
            raise InvalidRequest(f"{where}.image_url: an image_url part needs `image_url`, an "
                                 "object {\"url\": …}", param=f"{where}.image_url")
        check_image_url(image.get("url"), f"{where}.image_url.url")


def _check_tool_calls(calls: Any, where: str) -> None:
    """An assistant message's earlier `tool_calls` (OpenAI's or Ollama's shape)."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where}: `tool_calls` must be a list", param=where)
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"{where}.{k}: a tool call must be an object with `function`: "
                                 "{\"name\", \"arguments\"}", param=f"{where}.{k}")


def check_tools(tools: Any, tool_choice: Any = None, *, mcp: bool = True) -> None:
    """`tools`: a list of tool objects, a function tool naming its function, an `mcp` one
    (where the route runs the tool loop: `mcp`) naming its servers; `tool_choice`: none, auto,
    required, or {"type": "function", "function": {"name"}}. Any other type (`web_search`,
    `file_search`, …: hosted tools modelyard does not run) is refused here: a backend answers
    it with a 500."""
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequest("tools: must be a list of tools ({\"type\": \"function\", "
                                 "\"function\": {\"name\", \"parameters\"}})", param="tools")
        kinds = ("function", "mcp") if mcp else ("function",)
        for n, tool in enumerate(tools):
            where = f"tools.{n}"
            if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
                raise InvalidRequest(f"{where}: a tool must be an object with a `type` "
                                     f"({' or '.join(kinds)})", param=where)
            if tool["type"] not in kinds:
                raise ToolTypeUnsupported(
                    f"{where}.type: tool type {tool['type'][:64]!r} is not supported; "
                    f"supported: {', '.join(kinds)}", param=f"{where}.type")
            if tool["type"] == "mcp":
                _check_mcp_tool(tool, where)
                continue
            fn = tool.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise InvalidRequest(f"{where}.function: a function tool needs `function` with "
                                     "a `name`", param=f"{where}.function")
            if not isinstance(fn.get("parameters", {}), dict):
                raise InvalidRequest(f"{where}.function.parameters: must be a JSON schema "
                                     "object", param=f"{where}.function.parameters")
    _check_tool_choice(tool_choice)


def _check_mcp_tool(tool: dict[str, Any], where: str) -> None:
    """`{"type": "mcp", "server": ID}` or `{"type": "mcp", "servers": [ID, …]}` (whether the
    servers are declared is the tool loop's to say)."""
    servers = tool.get("servers")
    named = isinstance(tool.get("server"), str) and bool(tool["server"])
    listed = isinstance(servers, list) and bool(servers) and all(
        isinstance(s, str) and s for s in servers)
    if not named and not listed:
        raise InvalidRequest(f"{where}: an mcp tool names its server(s): {{\"type\": \"mcp\", "
                             "\"server\": ID}} or \"servers\": [ID, …]", param=where)


def _check_tool_choice(tool_choice: Any) -> None:
    if tool_choice is None or tool_choice in TOOL_CHOICES:
        return
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest("tool_choice: none, auto, required, or {\"type\": \"function\", "
                             "\"function\": {\"name\": …}}", param="tool_choice")


def check_openai_chat(data: dict[str, Any], *, mcp: bool = True) -> None:
    """An OpenAI-shaped chat body (OpenAI's route, native /chat): messages' content parts and
    tool calls, `tools` (`mcp` ones where the route runs the tool loop), `tool_choice`.
    Messages themselves are checked by the route's model."""
    for i, message in enumerate(_listed(data.get("messages"))):
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                _check_part(part, f"messages.{i}.content.{j}")
        _check_tool_calls(message.get("tool_calls"), f"messages.{i}.tool_calls")
    check_tools(data.get("tools"), data.get("tool_choice"), mcp=mcp)


def check_ollama_images(images: Any, where: str) -> None:
    """Ollama's `images`: a list of base64 strings."""
    if images is None:
        return
    if not isinstance(images, list):
        raise InvalidRequest(f"{where}: `images` must be a list of base64 strings", param=where)
    for k, image in enumerate(images):
        if not isinstance(image, str):
            raise InvalidRequest(f"{where}.{k}: an image must be a base64 string",
                                 param=f"{where}.{k}")
        check_image_data(image, f"{where}.{k}")


def check_ollama_chat(data: dict[str, Any]) -> None:
    """An Ollama /api/chat body before it is translated: each message's `images` and
    `tool_calls`, and `tools`."""
    for i, message in enumerate(_listed(data.get("messages"))):
        if isinstance(message, dict):
            check_ollama_images(message.get("images"), f"messages.{i}.images")
            _check_tool_calls(message.get("tool_calls"), f"messages.{i}.tool_calls")
    check_tools(data.get("tools"))


def has_images(messages: Any) -> bool:
    """Whether OpenAI-shaped `messages` carry an image part (Ollama's `images` become these)."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
                isinstance(p, dict) and p.get("type") == "image_url" for p in content):
            return True
    return False
