"""The OpenAI Responses API's shapes, both ways: a request's `input` items, `instructions`,
function `tools`, `tool_choice` and `text.format` as an OpenAI chat body (what every backend
serves), and an answer (a `Generation`) as a Response object with its `output` items.

Plain functions over the parsed JSON, like front/chat/shapes.py: an error names the field as the
client wrote it (`input.2.content.0.image_url`), a 400 `invalid_request` before anything is
leased. What the chat API cannot express (hosted tools such as web_search, `file_id` inputs,
`item_reference`) is refused by name rather than dropped.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from modelyard.errors import InvalidRequest, ToolTypeUnsupported
from modelyard.front.chat.shapes import check_image_url
from modelyard.front.chat.translate import Generation

ROLES = {"user": "user", "assistant": "assistant", "system": "system",
         "developer": "system"}  # chat templates know `system`; `developer` is OpenAI's new name
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _text_of(part: dict[str, Any], where: str) -> str:
    text = part.get("refusal") if part.get("type") == "refusal" else part.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.text: a {part.get('type')} part needs `text`, a string",
                             param=f"{where}.text")
    return text


def _content(content: Any, role: str, where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content: a string, or text and image_url parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}: content must be a string or a list of parts",
                             param=where)
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        at = f"{where}.{k}"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(part, dict) or not isinstance(kind, str):
            raise InvalidRequest(f"{at}: a content part must be an object with a `type` "
                                 "(input_text, input_image, output_text)", param=at)
        if kind in TEXT_PARTS:
            parts.append({"type": "text", "text": _text_of(part, at)})
        elif kind == "input_image":
            url = part.get("image_url")
            if url is None and part.get("file_id") is not None:
                raise InvalidRequest(f"{at}.file_id: files are not supported; send the image "
                                     "as `image_url` (a data URL or an http(s) URL)",
                                     param=f"{at}.file_id")
            check_image_url(url, f"{at}.image_url")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise InvalidRequest(f"{at}: part type {kind!r} is not supported (input_text, "
                                 "input_image, output_text)", param=f"{at}.type")
    if role != "user" or all(p["type"] == "text" for p in parts):
        # Text only: one string, which every chat template renders.
        return "".join(p["text"] for p in parts)
    return parts


def input_messages(input_: Any, param: str = "input") -> list[dict[str, Any]]:
    """`input` (a string or a list of items) as OpenAI chat messages."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    if not isinstance(input_, list):
        raise InvalidRequest(f"{param}: must be a string or a list of input items",
                             param=param)
    out: list[dict[str, Any]] = []
    for n, item in enumerate(input_):
        where = f"{param}.{n}"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where}: an input item must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise InvalidRequest(f"{where}.role: must be one of user, assistant, system, "
                                     "developer", param=f"{where}.role")
            out.append({"role": ROLES[role],
                        "content": _content(item.get("content"), role, f"{where}.content")})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            args = item.get("arguments", "")
            if not isinstance(call_id, str) or not isinstance(name, str) or not name \
                    or not isinstance(args, str):
                raise InvalidRequest(f"{where}: a function_call needs `call_id`, `name` and "
                                     "`arguments` (JSON text)", param=where)
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and isinstance(
                    last.get("content"), str | None):  # parallel calls: one assistant message
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if isinstance(output, list):  # output parts: their text
                output = _content(output, "tool", f"{where}.output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise InvalidRequest(f"{where}: a function_call_output needs `call_id` and "
                                     "`output` (a string)", param=where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # a previous answer's reasoning: not sent back to the model
        else:
            raise InvalidRequest(f"{where}.type: input item type {kind!r} is not supported "
                                 "(message, function_call, function_call_output)",
                                 param=f"{where}.type")
    return out


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat tools."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools: must be a list of function tools", param="tools")
    out = []
    for n, tool in enumerate(tools):
        where = f"tools.{n}"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            # Hosted tools (web_search, file_search, mcp, …) are OpenAI's to run, not ours.
            raise ToolTypeUnsupported(f"{where}.type: tool type {str(kind)[:64]!r} is not "
                                      "supported; supported: function", param=f"{where}.type")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"{where}.name: a function tool needs a `name`",
                                 param=f"{where}.name")
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequest(f"{where}.parameters: must be a JSON schema object",
                                 param=f"{where}.parameters")
        fn: dict[str, Any] = {"name": name, "parameters": params or {"type": "object",
                                                                    "properties": {}}}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        if isinstance(tool.get("strict"), bool):
            fn["strict"] = tool["strict"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest("tool_choice: none, auto, required, or {\"type\": \"function\", "
                         "\"name\": …}", param="tool_choice")


def response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as the chat `response_format`."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt, dict) and isinstance(fmt.get("schema"), dict):
        schema: dict[str, Any] = {"name": str(fmt.get("name") or "response"),
                                  "schema": fmt["schema"]}
        if isinstance(fmt.get("strict"), bool):
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequest("text.format: {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                         "{\"type\": \"json_schema\", \"name\", \"schema\"}",
                         param="text.format")


# ---- the answer --------------------------------------------------------------------------


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [] if status == "in_progress" else [output_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str = "completed") -> dict[str, Any]:  # fmt: skip
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def usage(gen: Generation) -> dict[str, Any]:
    return {"input_tokens": gen.prompt_tokens,
            "input_tokens_details": {"cached_tokens": min(gen.cached_tokens, gen.prompt_tokens)},
            "output_tokens": gen.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


def incomplete(gen: Generation) -> bool:
    return gen.finish_reason == "length"


def response_object(head: dict[str, Any], output: list[dict[str, Any]],
                    gen: Generation | None, status: str) -> dict[str, Any]:  # fmt: skip
    """The Response object: `head` (the request's echo, from `response_head`) with this state."""
    out = {**head, "status": status, "output": output}
    if gen is not None and status != "in_progress":
        out["usage"] = usage(gen)
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        out["completed_at"] = int(time.time())
    return out


def response_head(resp_id: str, model: str, data: dict[str, Any], *, store: bool,
                  ) -> dict[str, Any]:
    """What a Response echoes of its request, and its empty state."""
    return {
        "id": resp_id, "object": "response", "created_at": int(time.time()),
        "status": "in_progress", "model": model, "output": [], "error": None,
        "incomplete_details": None, "instructions": data.get("instructions"),
        "max_output_tokens": data.get("max_output_tokens"),
        "metadata": data.get("metadata") or {},
        "parallel_tool_calls": data.get("parallel_tool_calls", True),
        "previous_response_id": data.get("previous_response_id"),
        "temperature": data.get("temperature"), "top_p": data.get("top_p"),
        "tool_choice": data.get("tool_choice") or "auto", "tools": data.get("tools") or [],
        "text": data.get("text") or {"format": {"type": "text"}},
        "truncation": "disabled", "store": store, "usage": None,
    }
