"""Server-sent events as the OpenAI API frames them: one `data: <json>` line per event, blank
lines between events, and a last `data: [DONE]`. The relay, the session recorder and the archive
all read upstream streams through `read_event`, and write events with `sse_event`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Literal

import orjson

DONE: Literal["done"] = "done"


def sse_event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def read_event(line: bytes) -> dict[str, Any] | Literal["done"] | None:
    """What one SSE line carries: its JSON object, `DONE` for `data: [DONE]`, None for any other
    line (blank, comment, `event:`, a JSON value that is not an object).

    Raises ValueError (orjson's JSONDecodeError) for a `data:` line that is not JSON, e.g. one
    cut short by a client that left: each reader decides whether that is fatal.
    """
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return DONE
    event = orjson.loads(payload)
    return event if isinstance(event, dict) else None


def readable_events(lines: Iterable[bytes]) -> Iterator[dict[str, Any] | Literal["done"]]:
    """The events `lines` carry, passing over `data:` lines that are not JSON (a line cut short
    by a client that left): for readers that record a stream, not relay it."""
    for line in lines:
        try:
            event = read_event(line)
        except orjson.JSONDecodeError:
            continue
        if event is not None:
            yield event


class LineSplitter:
    """Whole lines out of bytes that arrive cut anywhere (the rest waits for the next chunk)."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        lines = (self._rest + chunk).split(b"\n")
        self._rest = lines.pop()
        return lines
