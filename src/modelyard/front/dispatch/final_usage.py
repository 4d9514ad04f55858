"""The backend's final usage in an OpenAI stream relayed as bytes (DESIGN.md §3.13, §3.14).

A passthrough stream is not parsed: its chunks go to the client as they come. Only its end is
read — the finishing event (the first carrying a `finish_reason`, or a native completion's
`"stop":true`) and what follows it (the usage chunk, `[DONE]`) are held until the backend's
answer is complete, then the usage they carry is reported (the request's `usage` event) and
they go on. Each chunk before costs a search for that mark, no copy: a chunk is passed on
whole unless it ends inside a line (then its last partial line waits for the next chunk, so a
mark split over two reads is still found).

A client that did not ask `stream_options.include_usage` gets the request sent upstream with it
(`ask_upstream`) and the usage-only chunk (`"choices": []`) removed again here (`strip`): the
stream it gets is the one it would have had without the question. llama-server puts its
`timings` on the stream's last event, so they move back from the usage chunk onto the finishing
event, as their own bytes, where llama-server would have put them (its keys are sorted:
`timings` ends an event without `usage`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from modelyard.metrics import Usage, usage_of

_MARKS = (b'"finish_reason":"', b'"finish_reason": "', b'"stop":true')
_TIMINGS = b'"timings":'
USAGE_OPTION = {"include_usage": True}


def ask_upstream(payload: dict[str, Any], body: bytes) -> tuple[bytes, bool] | None:
    """The request `body` (of `payload`) asking its backend for the usage chunk, and whether
    that chunk must be stripped (the client did not ask for it); None when it asked already."""
    options = payload.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return None
    if options is None and body[:1] == b"{" and body[1:2] not in (b"}", b""):
        # the client's bytes, with the option in front: no re-encoding of the whole request
        return b'{"stream_options":{"include_usage":true},' + body[1:], True
    merged = {**options, **USAGE_OPTION} if isinstance(options, dict) else USAGE_OPTION
    return orjson.dumps({**payload, "stream_options": merged}), True


class FinalUsage:
    """Follows one raw stream: `feed` each upstream chunk (what to send now comes back),
    `end` once it is complete (the held end, usage reported through `report`), or `broken`
    when it broke (what was held goes out unchanged)."""

    __slots__ = ("_held", "_partial", "report", "strip")

    def __init__(self, report: Callable[[Usage], None], *, strip: bool) -> None:
        self.report = report  # the request's usage event
        self.strip = strip
        self._partial = b""  # a chunk's last line, incomplete
        self._held: list[bytes] | None = None  # from the finishing event on

    def feed(self, chunk: bytes) -> bytes:
        if self._held is not None:
            self._held.append(chunk)
            return b""
        if self._partial:
            chunk, self._partial = self._partial + chunk, b""
        if not chunk.endswith(b"\n"):
            cut = chunk.rfind(b"\n") + 1
            chunk, self._partial = chunk[:cut], chunk[cut:]
        for mark in _MARKS:
            at = chunk.find(mark)
            if at >= 0:
                start = chunk.rfind(b"\n", 0, at) + 1
                self._held = [chunk[start:], self._partial]
                self._partial = b""
                return chunk[:start]
        return chunk

    def broken(self, left: bytes) -> bytes:
        """The stream broke: everything held, as it came, and `left` (its unread bytes)."""
        held, self._held = self._held or [], None
        rest, self._partial = self._partial, b""
        return b"".join(held) + rest + left

    def end(self) -> bytes:
        """The held end of a complete stream, its usage reported (and stripped if asked)."""
        held, self._held = self._held, None
        data = b"".join(held or ()) + self._partial
        self._partial = b""
        if not data:
            return data
        lines = data.split(b"\n")
        usage: Usage | None = None
        finishing = -1  # the line of the last event before the usage chunk
        dropped: set[int] = set()
        for i, line in enumerate(lines):
            if not line.startswith(b"data:") or b"{" not in line:
                continue
            try:
                event = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                continue
            if not isinstance(event, dict):
                continue
            usage = usage_of(event) or usage
            if self.strip and event.get("choices") == [] and "usage" in event:
                if finishing >= 0 and (timings := _raw_timings(line)) is not None:
                    lines[finishing] = _with_timings(lines[finishing], timings)
                dropped.add(i)
                if i + 1 < len(lines) and lines[i + 1] in (b"", b"\r"):
                    dropped.add(i + 1)  # the blank line that ended the event
            else:
                finishing = i
        if usage is not None:
            self.report(usage)
        if not dropped:
            return data
        return b"\n".join(line for i, line in enumerate(lines) if i not in dropped)


def _raw_timings(line: bytes) -> bytes | None:
    """`"timings":{...}` as the backend wrote it (a flat object of numbers)."""
    at = line.find(_TIMINGS)
    if at < 0:
        return None
    close = line.find(b"}", at)
    return None if close < 0 else line[at:close + 1]


def _with_timings(line: bytes, timings: bytes) -> bytes:
    """The event `line` with `timings` as its last key."""
    close = line.rstrip(b"\r").rfind(b"}")
    if close < 0 or _TIMINGS in line:
        return line
    return line[:close] + b"," + timings + line[close:]
