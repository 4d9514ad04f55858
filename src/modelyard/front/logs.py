"""Live logs: read and follow the logs of the front, of each engine and of each model's backend.

Where each source's lines are:
- the front: an in-memory ring of its own logging records (`LogBuffer`, a bounded deque fed by a
  logging handler on the root logger while the app runs);
- an engine process: `$home/logs/engine-N.log`, the file its supervisor points its stdout and
  stderr at; an engine inside the front (--single-process) logs into the same ring, tagged as
  engine records by logger name (`modelyard.engine…`);
- a model's child server (llama-server, vLLM, any OpenAI server, the test fake):
  `$home/logs/models/<id>.log` (engine/backends/openai_server.py `log_path`).

Files are read directly (same machine) rather than relayed through the processes that write them:
it costs the writers nothing and survives restarts.

Every line has a `seq`: an increasing position in its source, to be passed back as `after` to get
only the lines that follow. For a file it is the byte offset just past the line, so `after=0`
reads from the start; for the ring, a counter. A file that was rotated or truncated starts its
offsets again from 0: an `after` beyond a file's end reads that file from its start. Lines are
served whole (a line still being written waits for its newline) and with secrets redacted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import orjson

POLL_S = 0.25  # how often a follower looks for new lines: live enough, a stat() per look
MAX_LIMIT = 5000  # lines per read
_CHUNK = 64 * 1024
_MAX_READ_BYTES = 4 * 1024 * 1024  # per read: a burst is served in several batches
_MAX_LINE = 64 * 1024  # a "line" with no newline this long is served as it is

FRONT = "front"
ENGINE_LOGGERS = "modelyard.engine"  # records of an in-process engine (single-process mode)
_ENGINE_TAG = "engine"


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


# ---------------------------------------------------------------------------------------------
# Redaction: no credential leaves through the logs, whatever a backend printed.

_REDACTIONS: list[tuple[re.Pattern[str], str]] = [
    # `Bearer x` anywhere; whatever follows `Authorization:` (`Basic x`, a raw key)
    (re.compile(r"(?i)\b(bearer)(\s+)[A-Za-z0-9._~+/=:-]+"), r"\1\2[redacted]"),
    (re.compile(r"""(?i)\b(authorization["']?\s*[:=]\s*["']?)(?!bearer\s)((?:basic|digest|"""
                r"""token)\s+)?[^\s"',;]+"""), r"\1\2[redacted]"),
    # modelyard tokens (front/tokens.py), OpenAI-style and Hugging Face keys
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


# ---------------------------------------------------------------------------------------------
# Sources


class LogReader(Protocol):
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


class LogBuffer(logging.Handler):
    """The last `capacity` logging records of this process, with increasing seqs. Logging may
    happen on any thread.

    Records of the engine loggers belong to `engine_source` when an engine runs in this process
    (--single-process), to the front otherwise; that is decided when they are read, so records
    logged before the engine was known are filed right too."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self._records: deque[LogLine] = deque(maxlen=capacity)
        self._seq = 0
        self._guard = threading.Lock()  # emit (any thread) against readers (the event loop)
        self.engine_source: str | None = None  # the in-process engine's name, if any
        self._format = logging.Formatter("%(name)s: %(message)s")

    @staticmethod
    def tag_of(record: logging.LogRecord) -> str:
        name = record.name
        if name == ENGINE_LOGGERS or name.startswith(ENGINE_LOGGERS + "."):
            return _ENGINE_TAG
        return FRONT

    def _tags(self, source: str) -> frozenset[str]:
        if source == FRONT:
            return frozenset({FRONT} if self.engine_source else {FRONT, _ENGINE_TAG})
        return frozenset({_ENGINE_TAG} if source == self.engine_source else ())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self._format.format(record)
        except Exception:  # a broken record must not break the caller's logging
            self.handleError(record)
            return
        with self._guard:
            self._seq += 1
            self._records.append(LogLine(
                self._seq, self.tag_of(record), text, record.created, record.levelname.lower()
            ))

    @property
    def last_seq(self) -> int:
        return self._seq

    def lines(self, source: str, after: int | None, limit: int) -> tuple[list[LogLine], int]:
        """`source`'s records after seq `after` (or its last `limit`), oldest first, and the
        seq to continue after. An `after` beyond the last seq (the front restarted since)
        reads from the oldest record kept."""
        with self._guard:
            last = self._seq
            if after is not None and after > last:
                after = 0
            found: list[LogLine] = []
            tags = self._tags(source)
            if tags and (after is None or after < last):
                for line in reversed(self._records):
                    if after is not None and line.seq <= after:
                        break
                    if line.source in tags:
                        found.append(line)
        found.reverse()
        if after is None:
            chosen = found[-limit:]
        else:
            chosen = found[:limit]
            if len(found) > limit:
                last = chosen[-1].seq  # more are waiting: continue right after these
        return [LogLine(x.seq, source, redact(x.text), x.ts, x.level) for x in chosen], last

    @contextlib.contextmanager
    def capture(self, logger: logging.Logger | None = None) -> Iterator[LogBuffer]:
        """Receive `logger`'s records (the root logger's: everything) while in the block."""
        target = logger or logging.getLogger()
        target.addHandler(self)
        try:
            yield self
        finally:
            target.removeHandler(self)


class BufferLog:
    """One source's records in a LogBuffer (the front's, or an in-process engine's)."""

    def __init__(self, buffer: LogBuffer, name: str) -> None:
        self.buffer = buffer
        self.name = name

    def read(self, after: int | None, limit: int) -> tuple[list[LogLine], int]:
        return self.buffer.lines(self.name, after, limit)

    async def follow(
        self, after: int, poll_s: float = POLL_S
    ) -> AsyncGenerator[list[LogLine], None]:
        cursor = after
        while True:
            if self.buffer.last_seq != cursor:  # new records (or a restart: lower seqs)
                lines, cursor = self.read(cursor, MAX_LIMIT)
                if lines:
                    yield lines
                    continue
            yield []
            await asyncio.sleep(poll_s)
