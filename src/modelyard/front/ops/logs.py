"""Live logs of the front and of each engine, as the admin routes (front/api/logs.py) read them.

Where each source's lines are:
- the front: an in-memory ring of its own logging records (`LogBuffer`, a bounded deque fed by a
  logging handler on the root logger while the app runs);
- an engine process: the file its supervisor points its stdout and stderr at, read by its
  provider (front/engines/provider.py) through `EngineClient.read_log(None, …)`, so that lines are
  there while the engine is down; an engine inside the front (--single-process) logs into the
  same ring, tagged as engine records by logger name (`modelyard.engine…`);
- a model's child server (llama-server, vLLM, any OpenAI server, the test fake): served by the
  engine that owns it, through `EngineClient.read_log(model, …)` / `follow_log` — the front never
  opens an engine's files (DESIGN.md §3.11).

Line types, seqs and redaction: wire/logs.py; reading files: proc/logfile.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncGenerator, Iterator

from modelyard.wire.logs import MAX_LIMIT, POLL_S, LogLine, LogSource, redact

__all__ = ["ENGINE_LOGGERS", "FRONT", "MAX_LIMIT", "POLL_S", "BufferLog", "LogBuffer", "LogLine",
           "LogReader", "LogSource", "redact"]

FRONT = "front"
ENGINE_LOGGERS = "modelyard.engine"  # records of an in-process engine (single-process mode)
_ENGINE_TAG = "engine"

LogReader = LogSource  # what a route reads and follows


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
