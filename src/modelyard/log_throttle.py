"""A log line that anyone outside can trigger, written at most once per interval.

Some records are caused by whoever connects, not by what the server does: a refused hello on the
engine's lease channel is one any local user can send thousands of times a second, each one a
line in `logs/engine-N.log`. Such a record goes through a `Throttled` line: the first one of an
interval is written, the others are counted, and the next one written says how many were not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class Throttled:
    """`logger.log(level, message)` at most once per `every_s`; the lines held back are
    counted and their number is added to the next line written."""

    def __init__(
        self, logger: logging.Logger, level: int, message: str, every_s: float,
        *, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.level = level
        self.message = message
        self.every_s = every_s
        self._clock = clock
        self._last: float | None = None
        self.held_back = 0  # lines not written since the last one that was

    def __call__(self) -> None:
        now = self._clock()
        if self._last is not None and now - self._last < self.every_s:
            self.held_back += 1
            return
        if self.held_back:
            self.logger.log(self.level, "%s (and %d more like it in the %.0f s before)",
                            self.message, self.held_back, now - (self._last or now))
        else:
            self.logger.log(self.level, "%s", self.message)
        self._last = now
        self.held_back = 0
