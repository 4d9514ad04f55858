"""Several choices for one request (OpenAI's `n`, chat and text completions).

Backends generate them natively: llama-server reads `n` (its `n_cmpl`: the prompt is evaluated
once and its KV shared by one slot per choice, so it refuses more choices than it has slots),
the transformers engine runs them as rows of its batch, other OpenAI servers take `n` as they
take it. What the front adds, and only when `n > 1`:

- a bound (`max_choices`; for a llama.cpp model also `llama_server_parallel`, its slots), a 400
  `invalid_request` on `n` past it rather than the backend's own error shape;
- the usage of the whole request: llama-server reports each choice's own (a whole answer keeps
  only the first one's, a stream sends one usage per choice). A streamed answer's usages and
  `timings` are summed into one (OpenAI's: the prompt once, the completions added up), sent at the
  end; a whole answer is asked of the backend as a stream and assembled here (`assemble`), which is
  the only way to learn every choice's token count.

Everything else per choice already goes by `index` (a forced tool call, the completions logprobs
and echo: front/chat/openai_compat.py). A server-side session continues with choice 0, and the
archive keeps choice 0's text (with the whole request's usage): a transcript has one answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from modelyard.config import LlamaCppModel
from modelyard.errors import InvalidRequest


def check_n(n: int | None, *, max_choices: int, spec: Any, slots: int) -> int:
    """The request's `n` (1 when unset), or a 400 naming the bound it crosses; `slots`: the
    llama-server slots a llama.cpp model (`spec`) has."""
    if n is None or n == 1:
        return 1
    if n > max_choices:
        raise InvalidRequest(f"n: at most {max_choices} choices per request (`max_choices`)",
                             param="n")
    if isinstance(spec, LlamaCppModel) and n > slots:
        raise InvalidRequest(
            f"n: at most {slots} choices for this model (llama-server generates each in a slot "
            "of its own: `llama_server_parallel`)", param="n")
    return n


# What an `n > 1` request asks of the backend: a stream with every choice's usage.
UPSTREAM = {"stream": True, "stream_options": {"include_usage": True}}


@dataclass
class Usage:
    """The usages and `timings` of several choices, as one: the prompt is counted once (the
    choices share it; llama-server's later choices report it as all cached, so the fewest cached
    tokens are the prompt's real reuse), the completions are added up. A backend's `usage` is
    the figure; `timings` alone (a final chunk without a usage) are the fallback."""

    prompt: int = 0
    cached: int | None = None
    completion: int = 0
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
    _timed: Usage | None = None  # the figures from `timings`, while no `usage` came

    @property
    def seen(self) -> bool:
        return self.cached is not None or (self._timed is not None and self._timed.seen)

    def add(self, event: dict[str, Any]) -> None:
        """Take (and remove) `event`'s `usage` and `timings`."""
        usage = event.pop("usage", None)
        timings = event.pop("timings", None)
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details")
            cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
            self._count(_int(usage.get("prompt_tokens")), cached,
                        _int(usage.get("completion_tokens")))
        if isinstance(timings, dict):
            self.prompt_ms = max(self.prompt_ms, float(timings.get("prompt_ms") or 0.0))
            self.predicted_ms = max(self.predicted_ms, float(timings.get("predicted_ms") or 0.0))
            if not isinstance(usage, dict):
                self._timed = self._timed or Usage()
                cached = _int(timings.get("cache_n"))
                self._timed._count(_int(timings.get("prompt_n")) + cached, cached,
                                   _int(timings.get("predicted_n")))

    def _count(self, prompt: int, cached: int, completion: int) -> None:
        self.prompt = max(self.prompt, prompt)
        self.cached = cached if self.cached is None else min(self.cached, cached)
        self.completion += completion

    def _figures(self) -> Usage:
        return self if self.cached is not None or self._timed is None else self._timed

    def usage(self) -> dict[str, Any]:
        f = self._figures()
        return {"prompt_tokens": f.prompt, "completion_tokens": f.completion,
                "total_tokens": f.prompt + f.completion,
                "prompt_tokens_details": {"cached_tokens": f.cached or 0}}

    def timings(self) -> dict[str, Any]:
        """llama-server's `timings`, for the whole request (what the front's metrics read)."""
        f = self._figures()
        cached = f.cached or 0
        return {"cache_n": cached, "prompt_n": f.prompt - cached, "prompt_ms": self.prompt_ms,
                "predicted_n": f.completion, "predicted_ms": self.predicted_ms}


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


@dataclass
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: list[Any] | None = None
    finish_reason: str | None = None

    def take(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if isinstance(delta.get("content"), str):
                self.text.append(delta["content"])
            if isinstance(delta.get("reasoning_content"), str):
                self.reasoning.append(delta["reasoning_content"])
            for pos, call in enumerate(delta.get("tool_calls") or []):
                if isinstance(call, dict):
                    self._call(call, pos)
        elif isinstance(choice.get("text"), str):
            self.text.append(choice["text"])
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            self.logprobs = [*(self.logprobs or []), *logprobs["content"]]
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    def _call(self, call: dict[str, Any], pos: int) -> None:
        slot = self.calls.setdefault(int(call.get("index", pos)), {
            "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        if call.get("id"):
            slot["id"] = call["id"]
        fn = call.get("function")
        if isinstance(fn, dict):
            slot["function"]["name"] += str(fn.get("name") or "")
            slot["function"]["arguments"] += str(fn.get("arguments") or "")

    def whole(self, chat: bool) -> dict[str, Any]:
        logprobs = None if self.logprobs is None else {"content": self.logprobs}
        out: dict[str, Any] = {"index": self.index, "finish_reason": self.finish_reason,
                               "logprobs": logprobs}
        if not chat:
            return {**out, "text": "".join(self.text)}
        message: dict[str, Any] = {"role": "assistant",
                                   "content": "".join(self.text) if self.text else None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [c for _, c in sorted(self.calls.items())]
        return {**out, "message": message}


def assemble(body: bytes) -> bytes:
    """A backend's SSE answer (of a request whose client wants it whole) as the whole answer:
    every choice by index, the usage of all of them. An error event is returned as it came."""
    head: dict[str, Any] | None = None
    choices: dict[int, _Choice] = {}
    usage = Usage()
    for line in body.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        raw = line[5:].strip()
        if raw == b"[DONE]":
            break
        try:
            event = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(event, dict):
            continue
        if "error" in event:
            return orjson.dumps(event)
        usage.add(event)
        head = head or event
        for choice in event.get("choices") or []:
            if isinstance(choice, dict):
                index = int(choice.get("index") or 0)
                choices.setdefault(index, _Choice(index)).take(choice)
    if head is None:
        return body
    chat = str(head.get("object", "")).startswith("chat.")
    out = {k: v for k, v in head.items() if k not in ("choices", "usage", "timings")}
    out["object"] = "chat.completion" if chat else "text_completion"
    out["choices"] = [c.whole(chat) for _, c in sorted(choices.items())]
    if usage.seen:
        out["usage"] = usage.usage()
        out["timings"] = usage.timings()
    return orjson.dumps(out)
