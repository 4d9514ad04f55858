"""OpenAI fidelity where llama-server's OpenAI API differs from OpenAI's (issue 18, item 2).

Only requests that ask for one of these features are parsed and re-encoded; every other request
keeps the byte-for-byte passthrough (DESIGN.md §3.13). `prepare` says what a request needs:

- `tool_choice` naming a function: llama-server only reads the strings auto/none/required (and
  silently takes an object as "auto"), so the tools are narrowed to the named one and the choice
  becomes "required" (which the pipeline then enforces as a JSON schema: forced_call.py).
- `stream_options.include_usage`: OpenAI sends `"usage": null` on every chunk and the usage on a
  last chunk with empty `choices`; llama-server leaves `usage` out of the others and, for text
  completions, puts it on the finishing chunk.
- `logprobs: true` without `top_logprobs` (or with 0): OpenAI gives each token's logprob and no
  alternatives; llama-server computes none at all for 0 and defaults to 20 when unset, so it is
  asked for 1 and the alternatives are dropped.
- `n > 1`: every choice's usage, summed (front/chat/choices.py).
- legacy `functions` / `function_call`: the answer's tool call as `function_call`
  (front/chat/legacy_functions.py; the request is mapped to tools by the route).
- text completions: `echo` (the prompt before the text), an integer `logprobs` in the completions
  shape (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`; llama-server answers the chat
  shape), and `suffix` (served by llama-server's `/infill`; a model without fill-in-the-middle
  tokens gets a 400).

Errors: llama-server's `exceed_context_size_error` (and the transformers engine's, which speaks
the same shape) becomes OpenAI's `context_length_exceeded`, whose message clients match on
("maximum context length"): error bodies are small, so reading them costs nothing on success.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from modelyard.errors import InvalidRequest
from modelyard.front.chat import choices, legacy_functions
from modelyard.front.chat.forced_call import ForcedCall
from modelyard.front.sse import sse_event
from modelyard.metrics import note_usage, usage_of

INFILL_PATH = "/infill"

# The sampling fields an OpenAI text completion shares with llama-server's /infill.
_INFILL_FIELDS = ("temperature", "top_p", "stop", "seed", "stream", "presence_penalty",
                  "frequency_penalty", "logit_bias", "n_predict")  # fmt: skip


@dataclass
class Prepared:
    """A request that needs more than the passthrough: what goes upstream, and the reshaping
    its answer needs (None: the answer passes unchanged)."""

    payload: dict[str, Any]
    path: str
    reshape: Reshape | None


def prepare(path: str, data: dict[str, Any], *, chat: bool, n: int = 1,
            legacy: bool = False) -> Prepared | None:
    """What the OpenAI request `data` (bound for `path`) needs; None: nothing, pass it through.
    `n`: the choices it asks for (checked: front/chat/choices.py); `legacy`: it offered the
    legacy `functions` (mapped to `tools` in `data` already), and the answer goes back so."""
    payload = data
    reshape = Reshape(model=str(data.get("model", "")), legacy=legacy)
    stream = data.get("stream") is True
    options = data.get("stream_options")
    if stream and isinstance(options, dict) and options.get("include_usage") is True:
        reshape.include_usage = True
    if n > 1:
        reshape.n = n
        reshape.assemble = not stream
        payload = {**payload, **choices.UPSTREAM}
    if chat:
        choice = data.get("tool_choice")
        if isinstance(choice, dict):
            payload = {**payload, **_named_tool_choice(data, choice)}
        if data.get("logprobs") is True and not data.get("top_logprobs"):
            reshape.no_alternatives = True
            payload = {**payload, "top_logprobs": 1}
    else:
        payload = _prepare_completion(payload, reshape)
    if payload is data and not reshape.active:
        return None
    return Prepared(payload, INFILL_PATH if reshape.infill else path,
                    reshape if reshape.active else None)


def _named_tool_choice(data: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
    """`{"type": "function", "function": {"name": N}}` as llama-server can enforce it."""
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str) or not name:
        raise InvalidRequest(
            "tool_choice: expected \"auto\", \"none\", \"required\" or "
            "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    tools = data.get("tools")
    named = [t for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)
             and t["function"].get("name") == name] if isinstance(tools, list) else []  # fmt: skip
    if not named:
        raise InvalidRequest(f"tool_choice names function '{name}', which is not in `tools`",
                             param="tool_choice")
    return {"tools": named[:1], "tool_choice": "required"}


def _prepare_completion(data: dict[str, Any], reshape: Reshape) -> dict[str, Any]:
    payload = data
    prompt = data.get("prompt")
    if data.get("echo") is True:
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise InvalidRequest("echo: supported for text prompts only, not token ids",
                                 param="echo")
        reshape.echo = prompts
        payload = {k: v for k, v in payload.items() if k != "echo"}
    logprobs = data.get("logprobs")
    if isinstance(logprobs, int) and not isinstance(logprobs, bool) and logprobs is not None:
        if not 0 <= logprobs <= 20:
            raise InvalidRequest("logprobs: must be between 0 and 20", param="logprobs")
        reshape.logprobs = logprobs
        # llama-server reports nothing for 0; OpenAI still gives the chosen tokens' logprobs
        payload = {**payload, "logprobs": max(1, logprobs)}
    suffix = data.get("suffix")
    if isinstance(suffix, str) and suffix:
        if not isinstance(prompt, str):
            raise InvalidRequest("suffix: supported with a text prompt only", param="suffix")
        reshape.infill = True
        payload = _infill_payload(payload, prompt, suffix)
    return payload


def _infill_payload(data: dict[str, Any], prompt: str, suffix: str) -> dict[str, Any]:
    out = {k: data[k] for k in _INFILL_FIELDS if k in data}
    out.update(input_prefix=prompt, input_suffix=suffix, prompt="")
    if data.get("max_tokens") is not None:
        out["n_predict"] = data["max_tokens"]
    if isinstance(data.get("logprobs"), int):
        out["n_probs"] = data["logprobs"]
    return out


@dataclass
class Reshape:
    """What one answer needs done to it on its way to the client (streamed or whole)."""

    model: str
    include_usage: bool = False
    echo: list[str] | None = None  # the prompts, by choice index
    logprobs: int | None = None  # the completions shape, this many alternatives per token
    infill: bool = False  # the answer is llama-server's /infill (native) shape
    # a forced tool call llama-server answered as JSON text (front/chat/forced_call.py)
    forced: ForcedCall | None = None
    no_alternatives: bool = False  # chat logprobs without `top_logprobs`: each token's `[]`
    legacy: bool = False  # the tool call as the legacy `function_call`
    n: int = 1  # choices per prompt: usages summed, and the echo's prompt is index // n
    assemble: bool = False  # asked upstream as a stream, for a whole answer (choices.py)
    _usage: choices.Usage = field(default_factory=choices.Usage)
    _held: dict[str, Any] | None = None  # the last choice's finishing chunk (n > 1)
    _offsets: dict[int, int] = field(default_factory=dict)  # text_offset so far, by choice
    _echoed: set[int] = field(default_factory=set)

    @property
    def active(self) -> bool:
        return self.include_usage or self.echo is not None or self.logprobs is not None \
            or self.infill or self.forced is not None or self.no_alternatives or self.legacy \
            or self.n > 1

    def whole(self, body: bytes) -> bytes:
        if self.assemble:
            body = choices.assemble(body)
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return body
        if not isinstance(data, dict):
            return body
        if self.infill:
            data = self._from_infill(data)
        if self.forced is not None:
            data = self.forced.whole(data)
        for choice in data.get("choices") or []:
            self._choice(choice)
        return orjson.dumps(data)

    async def stream(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The upstream SSE, event by event, reshaped (other lines pass unchanged)."""
        pending = b""
        done = False
        async for chunk in chunks:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            done = done or any(line.startswith(b"data: [DONE]") for line in lines)
            out = b"".join(self._line(line) for line in lines)
            if out:
                yield out
        if pending.strip():
            yield self._line(pending)
        if self.infill and not done:  # /infill's native stream ends without OpenAI's [DONE]
            yield b"data: [DONE]\n\n"

    def _line(self, line: bytes) -> bytes:
        line = line.rstrip(b"\r")
        if not line:
            return b""
        if not line.startswith(b"data:"):
            return line + b"\n\n"
        raw = line[5:].strip()
        if raw == b"[DONE]" and self.n > 1:
            return self._flush() + line + b"\n\n"
        try:
            event = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return line + b"\n\n"
        if not isinstance(event, dict) or "error" in event:
            return line + b"\n\n"
        events = [event] if self.forced is None else self.forced.events(event)
        return b"".join(sse_event(out) for e in events for out in self._event(e))

    def _event(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        if self.infill:
            event = self._from_infill(event)
        for choice in event.get("choices") or []:
            self._choice(choice)
        events = [event] if self.n == 1 else self._several(event)
        return [out for e in events for out in self._usage_null(e)]

    def _several(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """n > 1: the usages (one per choice from llama-server) are summed and sent once, at
        the end; so are the `timings`, on the last finishing chunk (held until the next one or
        the end) when the client asked no usage (the front's metrics read them there)."""
        listed = event.get("choices") or []
        finishing = any(isinstance(c, dict) and c.get("finish_reason") for c in listed)
        if finishing or isinstance(event.get("usage"), dict):
            self._usage.add(event)
        if not listed:
            return []
        if not finishing:
            return [event]
        held, self._held = self._held, event
        return [] if held is None else [held]

    def _flush(self) -> bytes:
        held, self._held = self._held, None
        if self._usage.seen:  # the request's usage event: every choice's, summed
            note_usage(usage_of({"usage": self._usage.usage()}))
        events = []
        if held is not None:
            if not self.include_usage and self._usage.seen:
                held["timings"] = self._usage.timings()
            events.append(held)
        if self.include_usage and self._usage.seen and held is not None:
            head: dict[str, Any] = {k: held[k] for k in ("id", "object", "created", "model")
                                    if k in held}
            events.append({**head, "choices": [], "usage": self._usage.usage(),
                           "timings": self._usage.timings()})
        return b"".join(sse_event(out) for e in events for out in self._usage_null(e))

    def _usage_null(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        if not self.include_usage:
            return [event]
        listed = event.get("choices") or []
        usage = event.get("usage")
        if usage is None:
            return [{**event, "usage": None}]
        if not listed:
            return [event]
        # usage on a chunk that still carries choices (llama-server's text completions): split
        return [{**event, "usage": None}, {**event, "choices": [], "usage": usage}]

    def _choice(self, choice: dict[str, Any]) -> None:
        index = int(choice.get("index") or 0)
        prompt = index // self.n  # llama-server numbers a prompt's n choices in a row
        if self.echo is not None and index not in self._echoed and prompt < len(self.echo):
            self._echoed.add(index)
            choice["text"] = self.echo[prompt] + str(choice.get("text") or "")
            self._offsets[index] = len(self.echo[prompt])
        if self.logprobs is not None:
            choice["logprobs"] = self._completion_logprobs(index, choice.get("logprobs"))
        elif self.no_alternatives:
            content = (choice.get("logprobs") or {}).get("content")
            for item in content if isinstance(content, list) else []:
                if isinstance(item, dict):
                    item["top_logprobs"] = []
        if self.legacy:
            legacy_functions.answer_choice(choice)

    def _completion_logprobs(self, index: int, chat_shape: Any) -> dict[str, Any] | None:
        """llama-server's chat-shaped logprobs (`content: [{token, logprob, top_logprobs}]`) in
        the completions shape."""
        content = chat_shape.get("content") if isinstance(chat_shape, dict) else None
        if not isinstance(content, list):
            return None
        out: dict[str, list[Any]] = {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self._offsets.get(index, 0)
        for item in content:
            if not isinstance(item, dict):
                continue
            token = str(item.get("token", ""))
            out["tokens"].append(token)
            out["token_logprobs"].append(item.get("logprob"))
            top = item.get("top_logprobs") or []
            out["top_logprobs"].append(
                {str(t.get("token", "")): t.get("logprob") for t in top[: self.logprobs]
                 if isinstance(t, dict)})  # fmt: skip
            out["text_offset"].append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return out

    def _from_infill(self, data: dict[str, Any]) -> dict[str, Any]:
        """llama-server's native completion (`content`, `stop`, token counts) as an OpenAI
        text completion (chunk)."""
        if "choices" in data:  # already OpenAI's
            return data
        done = bool(data.get("stop"))
        finish = None
        if done:
            finish = "length" if data.get("stop_type") == "limit" else "stop"
        choice: dict[str, Any] = {"text": str(data.get("content") or ""), "index": 0,
                                  "logprobs": None, "finish_reason": finish}
        probs = data.get("completion_probabilities")
        if isinstance(probs, list):
            choice["logprobs"] = {"content": probs}
        out: dict[str, Any] = {"id": f"cmpl-{data.get('id_slot', 0)}-{time.time_ns()}",
                               "object": "text_completion", "created": int(time.time()),
                               "model": self.model, "choices": [choice]}
        if done and "tokens_predicted" in data:
            prompt_n = int(data.get("tokens_evaluated") or 0)
            completion_n = int(data.get("tokens_predicted") or 0)
            out["usage"] = {"prompt_tokens": prompt_n, "completion_tokens": completion_n,
                            "total_tokens": prompt_n + completion_n}
        return out


# ---- errors ------------------------------------------------------------------------------------


def context_overflow(status: int, body: bytes) -> tuple[int, int] | None:
    """(prompt tokens, context) when `body` is llama-server's `exceed_context_size_error`."""
    if status != 400 or b"exceed_context_size_error" not in body:
        return None
    try:
        err = orjson.loads(body).get("error")
        return int(err["n_prompt_tokens"]), int(err["n_ctx"])
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
        return None


def context_overflow_message(n_prompt: int, n_ctx: int) -> str:
    # OpenAI's own wording, which litellm matches ("maximum context length"), and the code in
    # the text: the openai SDK puts only `message` in str(error), where langchain-openai looks
    # for "context_length_exceeded".
    return (f"This model's maximum context length is {n_ctx} tokens. However, your messages "
            f"resulted in {n_prompt} tokens. Please reduce the length of the messages. "
            "(context_length_exceeded)")


def openai_error(status: int, body: bytes, *, infill: bool) -> tuple[int, bytes] | None:
    """An upstream error before the first byte in OpenAI's shape, where llama-server's differs;
    None: pass it unchanged."""
    if (counts := context_overflow(status, body)) is not None:
        return 400, orjson.dumps({"error": {
            "message": context_overflow_message(*counts), "type": "invalid_request_error",
            "param": "messages", "code": "context_length_exceeded"}})
    if infill and status in (404, 501):  # no fill-in-the-middle tokens, or no /infill at all
        return 400, orjson.dumps({"error": {
            "message": "suffix: this model cannot fill in the middle (it has no FIM tokens); "
                       "send the request without `suffix`",
            "type": "invalid_request_error", "param": "suffix", "code": "suffix_unsupported"}})
    return None
