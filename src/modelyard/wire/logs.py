"""Log lines as they cross from an engine to the front, and the redaction every line gets.

Every line has a `seq`: an increasing position in its source, to be passed back as `after` to get
only the lines that follow (for a file, the byte offset just past the line; for an in-memory ring,
a counter). A source is read (`read`) or followed (`follow`) through a `LogSource`; an engine
serves its backends' sources through `EngineClient.read_log` / `follow_log` (wire/engines.py).
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

POLL_S = 0.25  # how often a follower looks for new lines: live enough, a stat() per look
MAX_LIMIT = 5000  # lines per read


@dataclass(frozen=True)
class LogLine:
    seq: int
    source: str
    text: str
    ts: float | None = None
    level: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "ts": self.ts, "source": self.source, "level": self.level,
                "text": self.text}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LogLine:
        return cls(int(data["seq"]), str(data["source"]), str(data["text"]), data.get("ts"),
                   data.get("level"))


# ---------------------------------------------------------------------------------------------
# Redaction: no credential leaves through the logs, whatever a backend printed.

_REDACTIONS: list[tuple[re.Pattern[str], str]] = [
    # `Bearer x` anywhere; whatever follows `Authorization:` (`Basic x`, a raw key)
    (re.compile(r"(?i)\b(bearer)(\s+)[A-Za-z0-9._~+/=:-]+"), r"\1\2[redacted]"),
    (re.compile(r"""(?i)\b(authorization["']?\s*[:=]\s*["']?)(?!bearer\s)((?:basic|digest|"""
                r"""token)\s+)?[^\s"',;]+"""), r"\1\2[redacted]"),
    # modelyard tokens (front/identity/tokens.py), OpenAI-style and Hugging Face keys
    (re.compile(r"\bmy-[A-Za-z0-9_-]{20,}"), "my-[redacted]"),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"), "sk-[redacted]"),
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), "hf_[redacted]"),
    # password=…, "password": "…", api_key: …, secret=…
    (re.compile(r"""(?i)\b(password|passwd|api[_-]?key|secret)(["']?\s*[:=]\s*)"""
                r"""("[^"]*"|'[^']*'|[^\s,;&}]+)"""), r"\1\2[redacted]"),
]


def redact(text: str) -> str:
    for pattern, replacement in _REDACTIONS:
        text = pattern.sub(replacement, text)
    return text


class LogSource(Protocol):
    name: str

    def read(self, after: int | None, limit: int) -> tuple[list[LogLine], int]:
        """Lines after seq `after` (oldest first, at most `limit`), or the last `limit` lines
        when `after` is None; and the seq to follow from."""
        ...

    def follow(
        self, after: int, poll_s: float = POLL_S
    ) -> AsyncGenerator[list[LogLine], None]:
        """Batches of lines after seq `after` as they are written, until the caller stops; an
        empty batch every `poll_s` while nothing is written (a chance to stop)."""
        ...
