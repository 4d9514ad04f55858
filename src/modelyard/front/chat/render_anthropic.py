"""How the Anthropic Messages API frames the pipeline's answer (front/chat/pipeline.py).

A whole answer is one `message` object; a streamed one is Anthropic's events, in its order:
message_start, content_block_start, ping, content_block_delta (text_delta), content_block_stop,
then each tool call as a tool_use block (content_block_start, one input_json_delta with its
whole input, content_block_stop), message_delta (stop_reason and usage), message_stop. The
backend's OpenAI chunks carry a tool call's arguments in fragments that are only known to be
complete at the end, so the tool_use blocks are sent once the answer is done, as Ollama's
renderer does; the SDK builds the same message either way.

Unlike the other renderers, a stream's framing has state (whether message_start went out, which
block is open), so each request gets its own `AnthropicRender`; it holds nothing else.

Swap progress (a model loading before the first token) is sent as `ping` events: Anthropic has
no place for a status line in a message, and its SDK passes over pings, so the client's stream
stays open and its message stays the model's own.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import orjson
from starlette.responses import Response

from modelyard.errors import ModelyardError
from modelyard.front.chat import anthropic_shapes
from modelyard.front.chat.openai_compat import context_overflow
from modelyard.front.chat.render import Render
from modelyard.front.chat.request import ChatCall
from modelyard.front.chat.translate import Generation
from modelyard.front.state import upstream_message


def event(name: str, payload: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic frames them: `event:` named like the payload's type."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


PING = event("ping", {"type": "ping"})


def stop_reason(gen: Generation) -> str:
    if gen.tool_calls:
        return "tool_use"
    if gen.finish_reason == "length":
        return "max_tokens"
    # The backend names the stop sequence it stopped on (front/chat/translate.py); without
    # one, "stop" is the end of the turn.
    return "stop_sequence" if gen.stop_sequence is not None else "end_turn"


def matched_stop(gen: Generation) -> str | None:
    """The message's `stop_sequence`: the one it stopped on, else null."""
    return gen.stop_sequence if stop_reason(gen) == "stop_sequence" else None


def tool_use_id(backend_id: str) -> str:
    """Anthropic's tool ids start `toolu_`; the backend's id (llama-server's random one, or
    `call_…`) follows, so the client's tool_result names the same call back."""
    if backend_id.startswith("toolu_"):
        return backend_id
    return "toolu_" + (backend_id.removeprefix("call_") or uuid.uuid4().hex[:24])


def tool_uses(gen: Generation) -> list[dict[str, Any]]:
    """The answer's tool calls as tool_use blocks, their arguments parsed (`{}` if the model
    wrote something that is not a JSON object)."""
    blocks = []
    for _, slot in sorted(gen.tool_calls.items()):
        try:
            args = json.loads(slot["arguments"]) if slot["arguments"].strip() else {}
        except ValueError:
            args = {}
        blocks.append({"type": "tool_use", "id": tool_use_id(slot["id"]),
                       "name": slot["name"], "input": args if isinstance(args, dict) else {}})
    return blocks


def usage(gen: Generation) -> dict[str, Any]:
    # Anthropic's input_tokens are the ones not read from a cache; those are apart.
    cached = min(gen.cached_tokens, gen.prompt_tokens)
    return {"input_tokens": gen.prompt_tokens - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": gen.completion_tokens}


class AnthropicRender(Render):
    """One request's framing (see the module's docstring)."""

    def __init__(self) -> None:
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.started = False
        self.open_block: int | None = None  # the index of the text block being streamed
        self.blocks = 0  # content blocks begun so far

    def _start(self, call: ChatCall, gen: Generation) -> bytes:
        if self.started:
            return b""
        self.started = True
        message: dict[str, Any] = {
            "id": self.id, "type": "message", "role": "assistant", "model": call.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": 0}}
        return event("message_start", {"type": "message_start", "message": message})

    def progress(self, call: ChatCall, gen: Generation | None, text: str) -> bytes:
        return PING

    def error_event(self, exc: ModelyardError) -> bytes:
        return event("error", anthropic_shapes.error_body(exc))

    def upstream_error(self, call: ChatCall, status: int, content_type: str,
                       body: bytes) -> Response:  # fmt: skip
        if (counts := context_overflow(status, body)) is not None:
            # Anthropic's own wording, which its clients (litellm's `anthropic/`, Claude Code)
            # match to tell an overflow from other 400s.
            message = "prompt is too long: {} tokens > {} maximum".format(*counts)
        else:
            message = upstream_message(body)
        payload = anthropic_shapes.message_error(status, message)
        return Response(orjson.dumps(payload), status_code=status, media_type="application/json")

    def text(self, call: ChatCall, gen: Generation, text: str) -> bytes:
        out = self._start(call, gen)
        if self.open_block is None:
            self.open_block, self.blocks = self.blocks, self.blocks + 1
            block = {"type": "text", "text": ""}
            out += event("content_block_start", {"type": "content_block_start",
                                                 "index": self.open_block,
                                                 "content_block": block})
            out += PING
        delta = {"type": "text_delta", "text": text}
        return out + event("content_block_delta", {"type": "content_block_delta",
                                                   "index": self.open_block, "delta": delta})

    def done(self, call: ChatCall, gen: Generation) -> bytes:
        out = self._start(call, gen)
        if self.open_block is not None:
            out += event("content_block_stop", {"type": "content_block_stop",
                                                "index": self.open_block})
            self.open_block = None
        for block in tool_uses(gen):
            index, self.blocks = self.blocks, self.blocks + 1
            head = {**block, "input": {}}
            out += event("content_block_start", {"type": "content_block_start", "index": index,
                                                 "content_block": head})
            args = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            out += event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                 "delta": args})
            out += event("content_block_stop", {"type": "content_block_stop", "index": index})
        delta: dict[str, Any] = {"stop_reason": stop_reason(gen),
                                 "stop_sequence": matched_stop(gen)}
        out += event("message_delta", {"type": "message_delta", "delta": delta,
                                       "usage": usage(gen)})
        return out + event("message_stop", {"type": "message_stop"})

    def whole(self, call: ChatCall, gen: Generation) -> Response:
        content: list[dict[str, Any]] = []
        if gen.content:
            content.append({"type": "text", "text": gen.content})
        content.extend(tool_uses(gen))
        message: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant",
                                   "model": call.model,
                   "content": content, "stop_reason": stop_reason(gen),
                   "stop_sequence": matched_stop(gen),
                   "usage": usage(gen)}
        return Response(orjson.dumps(message), media_type="application/json")
