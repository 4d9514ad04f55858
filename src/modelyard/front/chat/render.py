"""How each chat API frames an answer: OpenAI's (the backend's bytes, passed through), Ollama's
NDJSON/JSON for /api/chat and /api/generate, and the native SSE/JSON of /chat.

The pipeline (front/chat/pipeline.py) does the work once; a renderer only says what the bytes
look like: a streamed text delta, the closing message, a whole answer, a swap-progress line, an
in-band error, and the response for an upstream error before the first byte (DESIGN.md §3.8).
Renderers hold no per-request state (the ChatCall and the Generation are passed in), so each API
has one instance for the life of the process.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.responses import Response

from modelyard.errors import ModelyardError
from modelyard.front.chat import openai_compat
from modelyard.front.chat.request import ChatCall
from modelyard.front.chat.tools import http as tool_loop_http
from modelyard.front.chat.tools.loop import ToolLoop
from modelyard.front.chat.translate import Generation, now_rfc3339
from modelyard.front.request_context import RequestContext
from modelyard.front.sse import sse_event
from modelyard.front.state import upstream_message

ToolLoopAnswer = Callable[[RequestContext, ToolLoop, str, bool], Awaitable[Response]]


class Render:
    """The framing an API gives the pipeline's answer."""

    media_type = "text/event-stream"
    # True: the backend's OpenAI bytes go to the client unchanged; False: the answer is read
    # into a Generation and re-framed by `text`, `done` and `whole`.
    passthrough = False
    # The MCP tool loop's answer in this API's shapes (front/chat/tools/http.py); None: the API
    # offers no tool loop.
    tool_loop: ToolLoopAnswer | None = None

    def progress(self, call: ChatCall, gen: Generation | None, text: str) -> bytes:
        """A swap-progress line, shown as the model's reasoning before its first token."""
        raise NotImplementedError

    def error_event(self, exc: ModelyardError) -> bytes:
        """An error after the first byte: in-band, in the stream's framing."""
        raise NotImplementedError

    def upstream_error(self, call: ChatCall, status: int, content_type: str,
                       body: bytes) -> Response:  # fmt: skip
        """The backend refused the request before the first byte (`status`, its body of
        `content_type`): that status, in this API's error shape."""
        raise NotImplementedError

    def text(self, call: ChatCall, gen: Generation, text: str) -> bytes:
        raise NotImplementedError

    def thinking(self, call: ChatCall, gen: Generation, text: str) -> bytes | None:
        """A streamed piece of the model's reasoning; None: this API does not show it."""
        return None

    def done(self, call: ChatCall, gen: Generation) -> bytes:
        raise NotImplementedError

    def whole(self, call: ChatCall, gen: Generation) -> Response:
        raise NotImplementedError


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def _ndjson(payload: dict[str, Any]) -> bytes:
    return orjson.dumps(payload) + b"\n"


# ---- OpenAI: the backend's bytes ---------------------------------------------------------------


class OpenAIRender(Render):
    passthrough = True
    tool_loop = staticmethod(tool_loop_http.openai_chat)

    def progress(self, call: ChatCall, gen: Generation | None, text: str) -> bytes:
        return swap_progress_chunk(call.model, text)

    def error_event(self, exc: ModelyardError) -> bytes:
        return sse_event(exc.openai_body())

    def upstream_error(self, call: ChatCall, status: int, content_type: str,
                       body: bytes) -> Response:  # fmt: skip
        infill = call.reshape is not None and call.reshape.infill
        return openai_upstream_error(status, content_type, body, infill=infill)


def swap_progress_chunk(model: str, text: str) -> bytes:
    """A chat chunk carrying swap progress as reasoning, before the first token."""
    delta = {"role": "assistant", "content": None, "reasoning_content": text + "\n"}
    return sse_event(
        {"id": "chatcmpl-modelyard-swap", "object": "chat.completion.chunk",
         "created": int(time.time()), "model": model,
         "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    )


# ---- Ollama: NDJSON, statistics in nanoseconds -------------------------------------------------


class _OllamaRender(Render):
    media_type = "application/x-ndjson"

    def shape(self, call: ChatCall, gen: Generation, text: str | None,
              done: bool) -> dict[str, Any]:  # fmt: skip
        raise NotImplementedError

    def progress(self, call: ChatCall, gen: Generation | None, text: str) -> bytes:
        # Ollama's clients show `thinking` as the model's reasoning (chat: in the message).
        assert gen is not None
        out = self.shape(call, gen, "", False)
        out.get("message", out)["thinking"] = text + "\n"
        return _ndjson(out)

    def error_event(self, exc: ModelyardError) -> bytes:
        return _ndjson(exc.ollama_body())

    def upstream_error(self, call: ChatCall, status: int, content_type: str,
                       body: bytes) -> Response:  # fmt: skip
        if (counts := openai_compat.context_overflow(status, body)) is not None:
            return _json({"error": openai_compat.context_overflow_message(*counts)}, 400)
        return _json({"error": upstream_message(body)}, status)

    def text(self, call: ChatCall, gen: Generation, text: str) -> bytes:
        return _ndjson(self.shape(call, gen, text, False))

    def thinking(self, call: ChatCall, gen: Generation, text: str) -> bytes | None:
        # Ollama's `thinking` (chat: in the message), with empty text, as Ollama streams it.
        out = self.shape(call, gen, "", False)
        out.get("message", out)["thinking"] = text
        return _ndjson(out)

    def done(self, call: ChatCall, gen: Generation) -> bytes:
        return _ndjson(self.shape(call, gen, "", True))

    def whole(self, call: ChatCall, gen: Generation) -> Response:
        out = self.shape(call, gen, gen.content, True)
        if gen.thinking:
            out.get("message", out)["thinking"] = gen.thinking
        return _json(out)


class OllamaChatRender(_OllamaRender):
    """/api/chat: `message` objects."""

    tool_loop = staticmethod(tool_loop_http.ollama_chat)

    def shape(self, call: ChatCall, gen: Generation, text: str | None,
              done: bool) -> dict[str, Any]:  # fmt: skip
        out: dict[str, Any] = {
            "model": call.model,
            "created_at": now_rfc3339(),
            "message": {"role": "assistant", "content": text},
            "done": done,
        }
        if gen.tool_calls and (done or text is None):
            out["message"]["content"] = text or ""
            out["message"]["tool_calls"] = gen.ollama_tool_calls()
        if done:
            out["done_reason"] = gen.done_reason
            out.update(gen.stats())
        return out

    def done(self, call: ChatCall, gen: Generation) -> bytes:
        """Like Ollama: one chunk carrying the complete tool calls (if the answer has any),
        then the closing chunk."""
        if not gen.tool_calls:
            return super().done(call, gen)
        calls = _ndjson(self.shape(call, gen, None, False))
        calls_done = gen.tool_calls
        gen.tool_calls = {}
        try:
            return calls + _ndjson(self.shape(call, gen, "", True))
        finally:
            gen.tool_calls = calls_done


class OllamaGenerateRender(_OllamaRender):
    """/api/generate: `response` text."""

    def shape(self, call: ChatCall, gen: Generation, text: str | None,
              done: bool) -> dict[str, Any]:  # fmt: skip
        out: dict[str, Any] = {
            "model": call.model,
            "created_at": now_rfc3339(),
            "response": text,
            "done": done,
        }
        if done:
            out["done_reason"] = gen.done_reason
            out.update(gen.stats())
            if call.context_prefix is not None:  # front/chat/ollama_context.py
                out["context"] = [*call.context_prefix, *gen.token_ids]
        return out


# ---- native /chat: SSE deltas, Ollama-style statistics -----------------------------------------


class NativeRender(Render):
    def progress(self, call: ChatCall, gen: Generation | None, text: str) -> bytes:
        return sse_event({"delta": {"reasoning_content": text + "\n"}, "done": False})

    def error_event(self, exc: ModelyardError) -> bytes:
        return sse_event(exc.native_body())

    def upstream_error(self, call: ChatCall, status: int, content_type: str,
                       body: bytes) -> Response:  # fmt: skip
        err = ModelyardError(upstream_message(body), model=call.model)
        return _json({**err.native_body(), "error": "upstream_error"}, status)

    def text(self, call: ChatCall, gen: Generation, text: str) -> bytes:
        return sse_event({"delta": {"content": text}, "done": False})

    def thinking(self, call: ChatCall, gen: Generation, text: str) -> bytes | None:
        return sse_event({"delta": {"reasoning_content": text}, "done": False})

    def done(self, call: ChatCall, gen: Generation) -> bytes:
        return sse_event({"delta": {}, **native_final(call.model, gen, with_message=False)})

    def whole(self, call: ChatCall, gen: Generation) -> Response:
        return _json(native_final(call.model, gen))


def native_final(model: str, gen: Generation, *, with_message: bool = True) -> dict[str, Any]:
    final: dict[str, Any] = {"model": model, "created_at": now_rfc3339()}
    if with_message:
        final["message"] = {"role": "assistant", "content": gen.content}
    if gen.tool_calls:  # the complete calls, OpenAI's shape (arguments as JSON text)
        final["tool_calls"] = gen.openai_tool_calls()
    return {**final, "done": True, "done_reason": gen.done_reason, **gen.stats()}


def openai_upstream_error(status: int, content_type: str, body: bytes, *,
                          infill: bool = False) -> Response:
    """A backend's refusal before the first byte, for an OpenAI client: its 4xx/5xx unchanged,
    but for llama-server's own shapes of errors OpenAI has a shape for (a context overflow)."""
    if (shaped := openai_compat.openai_error(status, body, infill=infill)) is not None:
        return Response(shaped[1], status_code=shaped[0], media_type="application/json")
    return Response(body, status_code=status, media_type=content_type)


OPENAI = OpenAIRender()
OLLAMA_CHAT = OllamaChatRender()
OLLAMA_GENERATE = OllamaGenerateRender()
NATIVE = NativeRender()
