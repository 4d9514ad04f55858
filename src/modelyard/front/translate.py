"""From the OpenAI wire format llama-server speaks to what Ollama and native clients expect.

`Generation` accumulates one answer, streamed or not: its text, why it stopped, and the token
counts and timings llama-server reports (`usage`, and its own `timings` object).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
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
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0

    @classmethod
    def start(cls) -> Generation:
        return cls(started_ns=time.monotonic_ns())

    def absorb(self, payload: dict[str, Any]) -> str:
        """Take one chunk or a whole response; return the text it adds."""
        added = ""
        for choice in payload.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            part = choice.get("delta") or choice.get("message") or {}
            text = part.get("content") if isinstance(part, dict) else None
            if text is None:
                text = choice.get("text")
            if isinstance(text, str):
                added += text
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        self.content += added
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = int(usage.get("prompt_tokens") or self.prompt_tokens)
            self.completion_tokens = int(usage.get("completion_tokens") or self.completion_tokens)
        timings = payload.get("timings")
        if isinstance(timings, dict):
            self.prompt_tokens = int(timings.get("prompt_n") or self.prompt_tokens)
            self.completion_tokens = int(timings.get("predicted_n") or self.completion_tokens)
            self.prompt_ms = float(timings.get("prompt_ms") or 0.0)
            self.predicted_ms = float(timings.get("predicted_ms") or 0.0)
        return added

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
