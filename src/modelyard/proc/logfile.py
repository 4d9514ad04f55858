"""Reading the log file a child process writes (proc/process.py `ChildProcess(log_file=…)`):
its tail, the lines after a seq, and following it through rotation and truncation.

Lines are served whole (a line still being written waits for its newline) and with secrets
redacted. A line's `seq` is the byte offset just past it, so `after=0` reads from the start. A
file that was rotated or truncated starts its offsets again from 0: an `after` beyond a file's end
reads that file from its start.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import AsyncGenerator
from datetime import datetime
from pathlib import Path
from typing import BinaryIO

import orjson

from modelyard.wire.logs import MAX_LIMIT, POLL_S, LogLine, redact

_CHUNK = 64 * 1024
_MAX_READ_BYTES = 4 * 1024 * 1024  # per read: a burst is served in several batches
_MAX_LINE = 64 * 1024  # a "line" with no newline this long is served as it is


# ---------------------------------------------------------------------------------------------
# Lines of files: modelyard's own format gives a time and a level; other lines are kept as is.

# request_ids.TEXT_FORMAT: "%(asctime)s %(levelname)s %(name)s: %(message)s%(request_tag)s"
_OURS = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) (DEBUG|INFO|WARNING|ERROR|CRITICAL) (.*)$"
)
# uvicorn's default: "INFO:     message"
_UVICORN = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+(.*)$")


def _json_line(text: str, seq: int, source: str) -> LogLine | None:
    """A `--log-format json` record (request_ids.JsonFormatter), else None."""
    try:
        entry = orjson.loads(text)
        stamp = datetime.fromisoformat(entry["ts"]).timestamp()
        message = str(entry["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    if rid := entry.get("request_id"):
        message += f" request_id={rid}"
    return LogLine(seq, source, redact(f"{entry.get('logger')}: {message}"), stamp,
                   str(entry.get("level")))


def parse_line(raw: str, seq: int, source: str) -> LogLine:
    text = raw.rstrip("\r\n")
    if text.startswith("{") and (parsed := _json_line(text, seq, source)) is not None:
        return parsed
    if m := _OURS.match(text):
        try:
            stamp = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
        except (ValueError, OverflowError):
            stamp = None
        ts = None if stamp is None else stamp + int(m.group(2)) / 1000
        return LogLine(seq, source, redact(m.group(4)), ts, m.group(3).lower())
    if m := _UVICORN.match(text):
        return LogLine(seq, source, redact(m.group(2)), None, m.group(1).lower())
    return LogLine(seq, source, redact(text))


def _lines_in(data: bytes, base: int, source: str, *, force_tail: bool = False) -> tuple[
    list[LogLine], int
]:
    """The whole lines of `data` (read at offset `base`) and the offset just past the last.

    A last line with no newline is left for later, unless `force_tail` (no newline in sight)."""
    lines = []
    start = 0
    while (nl := data.find(b"\n", start)) >= 0:
        if data[start:nl].strip():
            lines.append(parse_line(data[start:nl].decode("utf-8", "replace"), base + nl + 1,
                                    source))
        start = nl + 1
    if force_tail and start < len(data):
        lines.append(parse_line(data[start:].decode("utf-8", "replace"), base + len(data),
                                source))
        start = len(data)
    return lines, base + start


def _align(f: BinaryIO, offset: int, size: int) -> int:
    """A line start at or after `offset`: `offset` itself when a line ends just before it, else
    the start of the next line. Beyond the end (the file was rotated or truncated): 0."""
    if offset > size:
        return 0
    if offset <= 0:
        return 0
    f.seek(offset - 1)
    if f.read(1) == b"\n":
        return offset
    rest = f.read(_MAX_LINE)
    nl = rest.find(b"\n")
    return offset + nl + 1 if nl >= 0 else offset + len(rest)


def _read_forward(f: BinaryIO, offset: int, limit: int, source: str) -> tuple[
    list[LogLine], int
]:
    """Up to `limit` whole lines from line start `offset`, and where to continue."""
    lines: list[LogLine] = []
    pos = offset
    f.seek(pos)
    pending = b""
    read = 0
    while len(lines) < limit and read < _MAX_READ_BYTES:
        chunk = f.read(_CHUNK)
        if not chunk:
            break
        read += len(chunk)
        data = pending + chunk
        found, end = _lines_in(data, pos, source, force_tail=len(data) >= _MAX_LINE and
                               b"\n" not in data)
        if len(lines) + len(found) > limit:
            found = found[: limit - len(lines)]
            end = found[-1].seq
        lines += found
        pending = data[end - pos:]
        pos = end
    return lines, pos


def _read_tail(f: BinaryIO, size: int, limit: int, source: str) -> tuple[list[LogLine], int]:
    """The last `limit` whole lines, and the offset just past them."""
    start = size
    data = b""
    newlines = 0
    while start > 0 and newlines <= limit and size - start < _MAX_READ_BYTES:
        step = min(_CHUNK, start)
        start -= step
        f.seek(start)
        chunk = f.read(step)
        newlines += chunk.count(b"\n")
        data = chunk + data
    cut = 0
    if start > 0:  # the first bytes are the end of a line that began earlier
        nl = data.find(b"\n")
        if nl < 0:
            return [], size
        cut = nl + 1
    lines, end = _lines_in(data[cut:], start + cut, source)
    return lines[-limit:], end


class FileLog:
    """A log file some process appends to (it may not exist yet)."""

    def __init__(self, path: Path, name: str) -> None:
        self.path = path
        self.name = name

    def read(self, after: int | None, limit: int) -> tuple[list[LogLine], int]:
        try:
            f = self.path.open("rb")
        except FileNotFoundError:
            return [], 0
        with f:
            size = os.fstat(f.fileno()).st_size
            if after is None:
                return _read_tail(f, size, limit, self.name)
            return _read_forward(f, _align(f, after, size), limit, self.name)

    def _open(self) -> BinaryIO | None:
        try:
            return self.path.open("rb")
        except FileNotFoundError:
            return None

    async def follow(
        self, after: int, poll_s: float = POLL_S
    ) -> AsyncGenerator[list[LogLine], None]:
        """Keeps the file open, so lines written just before a rotation are still read (from the
        renamed file) before the new file is opened; a truncated file is read from its start."""
        f: BinaryIO | None = None
        pos = after
        try:
            while True:
                if f is None and (f := self._open()) is not None:
                    pos = _align(f, pos, os.fstat(f.fileno()).st_size)
                if f is not None:
                    lines, pos = await asyncio.to_thread(_read_forward, f, pos, MAX_LIMIT,
                                                         self.name)
                    if lines:
                        yield lines
                        continue  # there may be more right away
                    if self._replaced(f, pos):
                        f.close()
                        f, pos = None, 0
                        continue
                yield []
                await asyncio.sleep(poll_s)
        finally:
            if f is not None:
                f.close()

    def _replaced(self, f: BinaryIO, pos: int) -> bool:
        """True when the path now names another file (rotated) or the file shrank below `pos`
        (truncated): either way, reopen it and read from 0."""
        try:
            now = self.path.stat()
        except FileNotFoundError:
            return False  # rotated, the new one not created yet: keep the old one meanwhile
        if now.st_ino != os.fstat(f.fileno()).st_ino:
            return True
        return now.st_size < pos  # truncated: reopen and read from 0
