"""The activity view: the last requests the front served, those in flight, and a live feed.

`Activity` is a `RequestLog` sink (front/ops/request_log.py): each finished inference request
becomes one row in a ring of the last `activity_max_entries`, kept in memory only (usage
accounting keeps the durable totals). The metrics middleware also tells it when a request
begins and ends (`begin`/`end`: one dict insert and delete), so the view lists what is in flight
now, read lazily from the middleware's own `metrics.Request` (nothing is copied per request).

The live feed (`subscribe`) gives each client a bounded queue. The sink runs on the request
path, so it never waits for a reader: a client whose queue is full is dropped (its stream ends
and an EventSource reconnects), never the front slowed.

Who sees what: admins every row; anyone else only the rows of their own user (`owner_key`), and
an anonymous caller none (front/api/activity.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from modelyard import metrics as m
from modelyard.front.identity.principal import Principal
from modelyard.front.ops.request_log import RequestRecord, wall_clock_of

FEED_QUEUE_ROWS = 256  # rows a live client may fall behind by before it is dropped


@dataclass(frozen=True, slots=True)
class Filters:
    """`?model=&owner=&status=&api=`: None matches anything. `status`: `ok`, `error`, or an
    exact status ("200", "429", an in-band error code)."""

    model: str | None = None
    owner: str | None = None
    status: str | None = None
    api: str | None = None

    def match(self, row: dict[str, Any]) -> bool:
        if self.model is not None and row["model"] != self.model:
            return False
        if self.owner is not None and (row["owner"] or "") != self.owner:
            return False
        if self.api is not None and row["api"] != self.api:
            return False
        status = self.status
        if status == "ok":
            return bool(row["status"] == "200")
        if status == "error":
            return bool(row["status"] != "200")
        return status is None or row["status"] == status


def visible_to(principal: Principal, owner: str | None) -> bool:
    """Admins see every row; a user their own; an anonymous caller none."""
    return principal.is_admin or (principal.user is not None and owner == principal.user)


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def row_of(record: RequestRecord, capture_id: str | None = None) -> dict[str, Any]:
    """One finished request as the API and the Studio show it."""
    return {
        "id": record.request_id,
        "time": round(record.started_at, 3),
        "owner": record.user,
        "token_id": record.token_id,
        "model": record.model,
        "api": record.api,
        "path": record.path,
        "status": record.status,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "completion_tokens": record.completion_tokens,
        "ttft_s": _round(record.ttft_s),
        "tokens_per_s": _round(record.tokens_per_s, 2),
        "duration_s": _round(record.duration_s),
        "queue_wait_s": _round(record.queue_wait_s),
        "swapped": record.swapped,
        "batch_id": record.batch_id,
        "capture_id": capture_id,  # the archive item with its bodies (GET /archive/{id})
    }


@dataclass(slots=True)
class _InFlight:
    request: m.Request
    scope: MutableMapping[str, Any]  # the ASGI scope: the auth gate puts the principal there later
    request_id: str | None


class Feed:
    """One live client's queue of rows; `dropped` once it fell too far behind."""

    def __init__(self, principal: Principal, filters: Filters, size: int) -> None:
        self.principal = principal
        self.filters = filters
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(size)
        self.dropped = False
        self._wake = asyncio.Event()

    def offer(self, row: dict[str, Any]) -> bool:
        """Queue `row` if this client may see it; False when the client must be dropped."""
        if not (visible_to(self.principal, row["owner"]) and self.filters.match(row)):
            return True
        try:
            self.queue.put_nowait(row)
        except asyncio.QueueFull:
            self.dropped = True
            self._wake.set()
            return False
        return True

    async def next(self, timeout_s: float) -> dict[str, Any] | None:
        """The next row, or None after `timeout_s` without one (or once dropped)."""
        if self.dropped:
            return None
        getter = asyncio.ensure_future(self.queue.get())
        dropped = asyncio.ensure_future(self._wake.wait())
        try:
            done, _ = await asyncio.wait({getter, dropped}, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            dropped.cancel()
            if not getter.done():
                getter.cancel()
        return getter.result() if getter in done and not getter.cancelled() else None


class Activity:
    """The ring of finished requests, those in flight, the captures' ids and the live feeds."""

    def __init__(self, max_entries: int, *, feed_rows: int = FEED_QUEUE_ROWS) -> None:
        # The finished requests as recorded (with their capture's id): made into rows when read
        # (`row_of`), not for each request, as the ring is read far less often than written.
        self._records: deque[tuple[RequestRecord, str | None]] = deque(maxlen=max_entries)
        self._in_flight: dict[int, _InFlight] = {}
        self._capture: str | None = None  # the archive item of the record emitted next
        self._feeds: set[Feed] = set()
        self.feed_rows = feed_rows

    # ---- fed by the metrics middleware and the request log --------------------------------

    def begin(self, request: m.Request, scope: MutableMapping[str, Any],
              request_id: str | None) -> None:
        self._in_flight[id(request)] = _InFlight(request, scope, request_id)

    def end(self, request: m.Request) -> None:
        self._in_flight.pop(id(request), None)

    def note_capture(self, item_id: str) -> None:
        """The archive item the bodies of the record emitted next go to: the middleware calls
        this and then emits that record, with no await between (so no other record can)."""
        self._capture = item_id

    def __call__(self, record: RequestRecord) -> None:
        """The RequestLog sink: on the event loop, no awaits, no I/O."""
        capture, self._capture = self._capture, None
        self._records.append((record, capture))
        if self._feeds:
            row = row_of(record, capture)
            for feed in list(self._feeds):
                if not feed.offer(row):
                    self._feeds.discard(feed)

    # ---- read by the API ------------------------------------------------------------------

    def recent(self, principal: Principal, filters: Filters, limit: int) -> list[dict[str, Any]]:
        """Newest first, at most `limit`."""
        out: list[dict[str, Any]] = []
        for record, capture in reversed(self._records):
            if not visible_to(principal, record.user):
                continue
            row = row_of(record, capture)
            if filters.match(row):
                out.append(row)
                if len(out) >= limit:
                    break
        return out

    def in_flight(self, principal: Principal, filters: Filters,
                  now: float | None = None) -> list[dict[str, Any]]:
        """The requests being served now, oldest first."""
        clock = time.perf_counter() if now is None else now
        rows = [row for row in self._live_rows(clock)
                if visible_to(principal, row["owner"]) and _live_match(filters, row)]
        return sorted(rows, key=lambda r: r["time"])

    def _live_rows(self, clock: float) -> Iterator[dict[str, Any]]:
        for entry in list(self._in_flight.values()):
            request, principal = entry.request, entry.scope.get("modelyard.principal")
            answering = request.first_at is not None or request.opened
            yield {
                "id": entry.request_id,
                "time": round(wall_clock_of(request.started), 3),
                "owner": getattr(principal, "user", None),
                "token_id": getattr(principal, "token_id", None),
                "model": request.model,
                "api": request.api,
                "path": entry.scope.get("path"),
                # Before the answer opens it waits in the queue or for its model's load.
                "state": "answering" if answering else "waiting",
                "elapsed_s": round(clock - request.started, 3),
                "queue_wait_s": round(request.queue_wait_s, 4),
                "swapped": request.swapped,
                "batch_id": entry.scope.get("modelyard.batch_id"),
            }

    def subscribe(self, principal: Principal, filters: Filters) -> Feed:
        feed = Feed(principal, filters, self.feed_rows)
        self._feeds.add(feed)
        return feed

    def unsubscribe(self, feed: Feed) -> None:
        self._feeds.discard(feed)

    @property
    def feeds(self) -> int:
        return len(self._feeds)

    def rows(self) -> Iterable[dict[str, Any]]:
        return tuple(row_of(record, capture) for record, capture in self._records)


def _live_match(filters: Filters, row: dict[str, Any]) -> bool:
    # `status` filters finished requests; one in flight has none yet.
    return Filters(filters.model, filters.owner, None, filters.api).match(row)

