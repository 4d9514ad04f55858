"""A session turn's answer, read as it passes: the assistant's reply (content and tool calls)
from an OpenAI body or SSE stream, and what the backend said about the prompt's tokens (how many
were reused from its KV cache: `usage.prompt_tokens_details.cached_tokens`, or llama-server's
`timings.cache_n`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modelyard.front.chat.translate import Generation
from modelyard.front.sse import DONE, LineSplitter, readable_events


@dataclass
class TurnStats:
    """What the backend said about one turn's prompt; None where it said nothing."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens reused from the KV cache
    completion_tokens: int | None = None
    at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, "at": self.at}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TurnStats:
        return cls(data.get("prompt_tokens"), data.get("cached_tokens"),
                   data.get("completion_tokens"), float(data.get("at") or 0.0))



def turn_stats(payload: dict[str, Any], now: float) -> TurnStats | None:
    """Token counts in an OpenAI answer or its last chunk: `usage` (with
    `prompt_tokens_details.cached_tokens`) or llama-server's `timings` (`cache_n`)."""
    stats = TurnStats(at=now)
    found = False
    usage = payload.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens"), int):
            stats.prompt_tokens, found = usage["prompt_tokens"], True
        if isinstance(usage.get("completion_tokens"), int):
            stats.completion_tokens, found = usage["completion_tokens"], True
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            stats.cached_tokens, found = details["cached_tokens"], True
    timings = payload.get("timings")
    if isinstance(timings, dict):
        if isinstance(timings.get("cache_n"), int):
            stats.cached_tokens, found = timings["cache_n"], True
            if isinstance(timings.get("prompt_n"), int):  # prompt_n: the tokens not reused
                total = timings["prompt_n"] + timings["cache_n"]
                stats.prompt_tokens = max(stats.prompt_tokens or 0, total)
        if stats.completion_tokens is None and isinstance(timings.get("predicted_n"), int):
            stats.completion_tokens, found = timings["predicted_n"], True
    return stats if found else None


class Answer:
    """The assistant's reply, accumulated from an OpenAI body or its stream's chunks (the text and
    tool calls by translate.Generation, as for every other API), plus what a session needs
    beyond it: whether it failed or ended, and the payloads that carry its token counts."""

    def __init__(self) -> None:
        self.gen = Generation.start()
        self.failed = False
        self.done = False  # a whole body, or a stream that reached [DONE] / a finish_reason
        self.payloads: list[dict[str, Any]] = []  # the ones carrying usage or timings

    @property
    def content(self) -> str:
        return self.gen.content

    @property
    def finish_reason(self) -> str | None:
        return self.gen.finish_reason

    def absorb(self, payload: dict[str, Any]) -> None:
        if "error" in payload:
            self.failed = True
            return
        self.gen.absorb(payload)
        if "usage" in payload or "timings" in payload:
            self.payloads.append(payload)

    def message(self) -> dict[str, Any]:
        """The assistant message to store."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.gen.tool_calls:
            out["tool_calls"] = self.gen.openai_tool_calls()
            if not self.content:
                out["content"] = None
        return out

    @property
    def ok(self) -> bool:
        return self.done and not self.failed

    def stats(self, now: float) -> TurnStats | None:
        found = None
        for payload in self.payloads:
            got = turn_stats(payload, now)
            if got is not None:
                found = got if found is None else _merge(found, got)
        return found


def _merge(a: TurnStats, b: TurnStats) -> TurnStats:
    return TurnStats(
        b.prompt_tokens if b.prompt_tokens is not None else a.prompt_tokens,
        b.cached_tokens if b.cached_tokens is not None else a.cached_tokens,
        b.completion_tokens if b.completion_tokens is not None else a.completion_tokens,
        b.at,
    )


class SseAnswer(Answer):
    """An Answer fed with raw SSE bytes as they pass (lines may be cut across chunks)."""

    def __init__(self) -> None:
        super().__init__()
        self._lines = LineSplitter()

    def feed(self, chunk: bytes) -> None:
        for event in readable_events(self._lines.feed(chunk)):
            if event == DONE:
                self.done = True
            else:
                self.absorb(event)
