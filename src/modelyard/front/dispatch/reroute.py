"""A request whose engine went away before its first byte is routed again (issue 20).

Before the grant (and before anything was sent to the client) a request that meets an engine
that is down — its lease channel closed, fell silent, or its actor is unavailable: all
EngineUnavailable from `acquire` — has lost nothing but time, so another engine that can serve
the model takes it instead of the client getting a 503. Bounded two ways, so a cluster losing
engines one after another cannot keep a request forever: each engine is tried at most once (a
restarted one that fails again is not a reason to wait more), and all the tries together within
the model's queue timeout, the longest the client was promised to wait anyway.
"""

from __future__ import annotations

import asyncio
import logging

from modelyard.errors import EngineUnavailable

log = logging.getLogger("modelyard.front.dispatch")


class Reroutes:
    """The engines one request has tried, and until when it may try another."""

    def __init__(self, timeout_s: float) -> None:
        self._clock = asyncio.get_running_loop().time
        self._deadline = self._clock() + timeout_s
        self.tried: set[str] = set()

    def remaining_s(self) -> float:
        """What is left of the queue timeout for the next try (never 0: the queue needs > 0)."""
        return max(self._deadline - self._clock(), 0.001)

    def failed(self, engine: str, exc: EngineUnavailable, model: str) -> None:
        """`engine` could not take the request: return if another may be tried, else raise
        `exc` (the reason the client reads)."""
        self.tried.add(engine)
        if self._clock() >= self._deadline:
            raise exc
        log.warning("%s: %s; routing it to another engine", model, exc.message)
