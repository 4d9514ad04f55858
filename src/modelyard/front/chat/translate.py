"""From the OpenAI wire format llama-server speaks to what Ollama and native clients expect.

`Generation` accumulates one answer, streamed or not: its text, why it stopped, and the token
counts and timings llama-server reports (`usage`, and its own `timings` object).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def now_rfc3339() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


@dataclass
class Generation:
    started_ns: int
    load_duration_ns: int = 0
    content: str = ""
    # The backend's reasoning (llama-server's `reasoning_content`): Ollama's `thinking`.
    thinking: str = ""
    thinking_delta: str = ""  # the reasoning the last `absorb` added (streamed as it comes)
    finish_reason: str | None = None
    # The stop sequence of the request that ended the answer, when the backend says which:
    # llama-server in its `__verbose` object (asked for with `verbose`) or its native
    # `stopping_word`, vLLM and the transformers engine as the choice's `stop_reason`.
    stop_sequence: str | None = None
    # All prompt tokens, those reused from the backend's cache included (Ollama's
    # `prompt_eval_count`); `cached_tokens` says how many of them were reused.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
    # OpenAI tool calls by `index`: {"id", "name", "arguments" (JSON text, grown by deltas)}.
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)
    # The answer's token ids, when the backend returns them (llama-server's native completion
    # with `return_tokens`): Ollama's `context` (front/chat/ollama_context.py).
    token_ids: list[int] = field(default_factory=list)

    @classmethod
    def start(cls) -> Generation:
        return cls(started_ns=time.monotonic_ns())

    def absorb(self, payload: dict[str, Any]) -> str:
        """Take one chunk or a whole response; return the text it adds."""
        added = ""
        self.thinking_delta = ""
        for choice in payload.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            part = choice.get("delta") or choice.get("message") or {}
            text = part.get("content") if isinstance(part, dict) else None
            if text is None:
                text = choice.get("text")
            if isinstance(text, str):
                added += text
            reasoning = part.get("reasoning_content") if isinstance(part, dict) else None
            if isinstance(reasoning, str):
                self.thinking_delta += reasoning
            if isinstance(part, dict) and isinstance(part.get("tool_calls"), list):
                self._absorb_tool_calls(part["tool_calls"])
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                if isinstance(matched := choice.get("stop_reason"), str) and matched:
                    self.stop_sequence = matched
        if "choices" not in payload:  # llama-server's own shape (/infill, /completion)
            added += self._absorb_native(payload)
        elif isinstance(verbose := payload.get("__verbose"), dict):
            self._absorb_stop_word(verbose)
        self.content += added
        self.thinking += self.thinking_delta
        self._absorb_counts(payload)
        return added

    def _absorb_native(self, payload: dict[str, Any]) -> str:
        """llama-server's native completion: `content`, `stop` and why (`stop_type`)."""
        if payload.get("stop") is True:
            self.finish_reason = "length" if payload.get("stop_type") == "limit" else "stop"
            self._absorb_stop_word(payload)
        self.prompt_tokens = max(self.prompt_tokens, _int(payload.get("tokens_evaluated")))
        self.completion_tokens = _int(payload.get("tokens_predicted")) or self.completion_tokens
        if isinstance(tokens := payload.get("tokens"), list):
            self.token_ids += [t for t in tokens if isinstance(t, int)]
        text = payload.get("content")
        return text if isinstance(text, str) else ""

    def _absorb_stop_word(self, native: dict[str, Any]) -> None:
        """llama-server's `stop_type` "word": it stopped on `stopping_word`, one of the
        request's stop sequences (not the end of its turn, "eos")."""
        word = native.get("stopping_word")
        if native.get("stop_type") == "word" and isinstance(word, str) and word:
            self.stop_sequence = word

    def _absorb_counts(self, payload: dict[str, Any]) -> None:
        """Token counts and timings. llama-server's `usage.prompt_tokens` counts the whole prompt
        and `prompt_tokens_details.cached_tokens` the part reused from its cache, but its
        `timings.prompt_n` only the tokens it evaluated now (`cache_n` the reused ones): the
        whole prompt is `prompt_n + cache_n`, never `prompt_n` alone (a repeated prompt would
        count 1)."""
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = max(self.prompt_tokens, _int(usage.get("prompt_tokens")))
            self.completion_tokens = _int(usage.get("completion_tokens")) or self.completion_tokens
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                self.cached_tokens = max(self.cached_tokens, _int(details.get("cached_tokens")))
        timings = payload.get("timings")
        if isinstance(timings, dict):
            cached = _int(timings.get("cache_n"))
            self.cached_tokens = max(self.cached_tokens, cached)
            self.prompt_tokens = max(self.prompt_tokens, _int(timings.get("prompt_n")) + cached)
            self.completion_tokens = _int(timings.get("predicted_n")) or self.completion_tokens
            self.prompt_ms = float(timings.get("prompt_ms") or 0.0)
            self.predicted_ms = float(timings.get("predicted_ms") or 0.0)

    def _absorb_tool_calls(self, calls: list[Any]) -> None:
        for pos, call in enumerate(calls):
            if not isinstance(call, dict):
                continue
            index = call.get("index", pos)
            slot = self.tool_calls.setdefault(int(index), {"id": "", "name": "", "arguments": ""})
            if call.get("id"):
                slot["id"] = str(call["id"])
            fn = call.get("function") or {}
            if fn.get("name"):
                slot["name"] += str(fn["name"])
            args = fn.get("arguments")
            if isinstance(args, str):
                slot["arguments"] += args
            elif isinstance(args, dict):
                slot["arguments"] = json.dumps(args)

    def openai_tool_calls(self) -> list[dict[str, Any]]:
        return [{"id": slot["id"] or f"call_{index}", "type": "function",
                 "function": {"name": slot["name"], "arguments": slot["arguments"]}}
                for index, slot in sorted(self.tool_calls.items())]

    def ollama_tool_calls(self) -> list[dict[str, Any]]:
        """The calls in Ollama's shape: `function.arguments` is an object."""
        out = []
        for index in sorted(self.tool_calls):
            slot = self.tool_calls[index]
            try:
                args = json.loads(slot["arguments"]) if slot["arguments"].strip() else {}
            except ValueError:
                args = {}
            if not isinstance(args, dict):
                args = {}
            out.append({"function": {"name": slot["name"], "arguments": args}})
        return out

    @property
    def done_reason(self) -> str:
        return "length" if self.finish_reason == "length" else "stop"

    def stats(self) -> dict[str, Any]:
        """Ollama's closing statistics, durations in nanoseconds."""
        return {
            "total_duration": time.monotonic_ns() - self.started_ns,
            "load_duration": self.load_duration_ns,
            "prompt_eval_count": self.prompt_tokens,
            "prompt_eval_duration": int(self.prompt_ms * 1e6),
            "eval_count": self.completion_tokens,
            "eval_duration": int(self.predicted_ms * 1e6),
        }


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def ollama_messages_to_openai(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama chat messages as OpenAI's: an assistant's `tool_calls` get ids and JSON-string
    arguments; a `tool` message (Ollama names the tool in `tool_name`) gets the `tool_call_id`
    of the preceding assistant's call it answers (by name, else by order)."""
    out: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # (id, name) of calls not yet answered
    for n, msg in enumerate(messages):
        msg = dict(msg)
        calls = msg.get("tool_calls")
        if msg.get("role") == "assistant" and isinstance(calls, list) and calls:
            converted = []
            pending = []
            for k, call in enumerate(calls):
                fn = dict((call or {}).get("function") or {})
                args = fn.get("arguments", {})
                call_id = str((call or {}).get("id") or f"call_{n}_{k}")
                name = str(fn.get("name", ""))
                converted.append({
                    "id": call_id, "type": "function",
                    "function": {"name": name,
                                 "arguments": args if isinstance(args, str) else json.dumps(args)},
                })
                pending.append((call_id, name))
            msg["tool_calls"] = converted
        elif msg.get("role") == "tool" and "tool_call_id" not in msg:
            name = str(msg.pop("tool_name", None) or msg.get("name") or "")
            match = next((p for p in pending if p[1] == name), pending[0] if pending else None)
            if match is not None:
                pending.remove(match)
                msg["tool_call_id"] = match[0]
        out.append(msg)
    return out
