"""What each inference request leaves behind once it is over: one `RequestRecord`.

The request's record (`modelyard.metrics.Request`) is filled by its events (leased, usage — the
backend's own —, first byte, end); when it ended, front/ops/metrics.py builds this record from it
and hands it to every sink the front registered (`RequestLog.add_sink`): usage accounting
(front/ops/usage.py) and the activity view (front/ops/activity.py). Sinks run on the event loop,
on the request path: they must not await, must not do I/O (buffer, and flush elsewhere) and must
not raise (a sink that raises is logged and the others still run).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str | None
    started_at: float  # wall clock (time.time()) when the request arrived
    user: str | None  # None: anonymous (loopback with auth `auto`, auth `none`)
    token_id: str | None  # the API token it came with; None: a login session or anonymous
    api: str  # openai | anthropic | ollama | native | embeddings | rerank | service
    path: str
    model: str  # the catalog id it was routed to; "" if it never got that far
    status: str  # "200", another HTTP status, or the in-band error code of a broken stream
    prompt_tokens: int  # every prompt token, the cached ones included
    cached_tokens: int  # of prompt_tokens, those reused from the KV cache
    completion_tokens: int
    ttft_s: float | None  # time to the first token (streams and non-streams alike)
    duration_s: float
    queue_wait_s: float  # time spent in the model's queue
    swapped: bool  # it waited for its model to be loaded
    batch_id: str | None = None  # set for requests a batch (/v1/batches) ran
    streamed: bool = False  # its tokens came as a stream (else one whole answer)

    @property
    def ok(self) -> bool:
        return self.status == "200"

    @property
    def tokens_per_s(self) -> float | None:
        """Completion tokens per second: of a stream, after its first token; of a whole
        answer, over the request (prompt included: nothing finer is seen). None when not
        measurable."""
        if not self.completion_tokens:
            return None
        if not self.streamed:
            return self.completion_tokens / self.duration_s if self.duration_s > 0 else None
        if self.ttft_s is None:
            return None
        gen = self.duration_s - self.ttft_s
        return self.completion_tokens / gen if gen > 0 else None


Sink = Callable[[RequestRecord], None]


class RequestLog:
    """The front's fan-out of finished requests to its sinks."""

    def __init__(self) -> None:
        self._sinks: list[Sink] = []

    def add_sink(self, sink: Sink) -> None:
        self._sinks.append(sink)

    def remove_sink(self, sink: Sink) -> None:
        if sink in self._sinks:
            self._sinks.remove(sink)

    @property
    def active(self) -> bool:
        return bool(self._sinks)

    def emit(self, record: RequestRecord) -> None:
        for sink in self._sinks:
            try:
                sink(record)
            except Exception:  # one sink's bug must not cost a request or the other sinks
                log.exception("request log sink %r failed", sink)


def wall_clock_of(perf_started: float) -> float:
    """The wall-clock time of a `time.perf_counter()` reading taken a moment ago."""
    return time.time() - (time.perf_counter() - perf_started)
