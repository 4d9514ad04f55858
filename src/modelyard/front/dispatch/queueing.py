"""Per-model bounded queues in the front: a concurrency limit, priorities, Retry-After.

Each model admits at most `Limits.max_concurrency` requests at once; up to `Limits.max_queue`
more wait in that model's queue, higher `priority` first; within a priority, owners share the
model by weighted fair queuing (fair_share.py: a start tag per request, FIFO among equal tags,
so a single owner's requests stay FIFO). A request
that finds the queue full is refused at once with `QueueFull` (429, with a Retry-After estimate);
a waiter whose `timeout_s` runs out gets `QueueTimeout` (503, with Retry-After).

Hand-over is race-free (DESIGN.md §3.3): every waiter has its own future. Releasing a slot moves
it straight to the next live waiter (`running` does not drop), so a new `acquire()` that arrives
before the woken waiter resumes cannot take it. A waiter that is cancelled (client disconnect)
leaves the queue in its `except CancelledError`; if it had already been handed a slot but had not
resumed yet, it passes that slot on. A waiter whose future was cancelled but which has not run its
handler yet is skipped by the hand-over, so no wake-up is ever lost and no hole blocks the queue.

Retry-After estimate (`ModelQueues.retry_after_s`): a retry is sure to be admitted at once when
every current waiter has been admitted and one more slot has freed, i.e. after
`queued + 1` completions spread over `max_concurrency` slots:

    retry_after_s = max(1, avg_service_s * (queued + 1) / max_concurrency)

where `avg_service_s` is an EWMA (weight `EWMA_ALPHA`) of how long slots of that model were held,
measured with the injected clock; before the first release it is `DEFAULT_SERVICE_S`.

Everything runs on one event loop: no threads, no locks, no polling. Timeouts use the loop's
timer (`call_later`); the injected clock only measures waits and hold times for the statistics.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from modelyard import metrics
from modelyard.errors import QueueFull, QueueTimeout
from modelyard.front.dispatch.fair_share import FairTags, Tag

EWMA_ALPHA = 0.2
DEFAULT_SERVICE_S = 1.0
MIN_RETRY_AFTER_S = 1.0
_COMPACT_MIN_DEAD = 64

__all__ = [
    "DEFAULT_SERVICE_S",
    "EWMA_ALPHA",
    "Limits",
    "ModelQueues",
    "QueueFull",
    "QueueTimeout",
    "Slot",
]


@dataclass(frozen=True)
class Limits:
    max_concurrency: int
    """Requests of the model served at once (≥ 1)."""
    max_queue: int
    """Requests allowed to wait beyond the running ones (≥ 0; 0 = none may wait)."""

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future[Slot]
    priority: int
    seq: int
    enqueued_at: float
    request_id: str | None
    owner: str
    tag: Tag
    granted_at: float | None = None
    live: bool = True

    @property
    def key(self) -> tuple[int, float, int]:
        return (-self.priority, self.tag.start, self.seq)


@dataclass
class _OwnerFigures:
    running: int = 0
    queued: int = 0


@dataclass(eq=False)
class _ModelState:
    name: str
    limits: Limits
    running: int = 0
    queued: int = 0
    heap: list[tuple[int, float, int, _Waiter]] = field(default_factory=list)
    fair: FairTags = field(default_factory=FairTags)
    owners: dict[str, _OwnerFigures] = field(default_factory=dict)
    dead: int = 0
    by_request_id: dict[str, _Waiter] = field(default_factory=dict)
    admitted_total: int = 0
    rejected_total: int = 0
    timed_out_total: int = 0
    cancelled_total: int = 0
    avg_wait_s: float | None = None
    avg_service_s: float | None = None

    def live_waiters(self) -> list[_Waiter]:
        return [entry[-1] for entry in self.heap if entry[-1].live]

    def owner(self, name: str) -> _OwnerFigures:
        found = self.owners.get(name)
        if found is None:
            found = self.owners[name] = _OwnerFigures()
        return found

    def forget_idle(self, name: str) -> None:
        """An owner with nothing running or queued leaves the figures (bounded by demand)."""
        figures = self.owners.get(name)
        if figures is not None and figures.running == 0 and figures.queued == 0:
            del self.owners[name]


def _ewma(current: float | None, sample: float) -> float:
    return sample if current is None else current + EWMA_ALPHA * (sample - current)


class Slot:
    """One admitted request of one model. `release()` is idempotent and never awaits.

    Use `slot = await queues.acquire(...)` then `try: ... finally: slot.release()`, or
    `with await queues.acquire(...):`.
    """

    __slots__ = ("_granted_at", "_owner", "_released", "_state", "owner")

    def __init__(
        self, owner: ModelQueues, state: _ModelState, granted_at: float, request_owner: str = ""
    ) -> None:
        self._owner = owner
        self._state = state
        self._granted_at = granted_at
        self._released = False
        self.owner = request_owner  # whose request holds the slot (fair share)

    @property
    def model(self) -> str:
        return self._state.name

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        self._finish(record=True)

    def _finish(self, *, record: bool) -> None:
        if self._released:
            return
        self._released = True
        self._owner._release(self._state, self._granted_at, self.owner, record=record)

    def __enter__(self) -> Slot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class ModelQueues:
    """The front's per-model admission: one bounded priority queue per model."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._models: dict[str, _ModelState] = {}
        self._seq = itertools.count()

    # -- admission ---------------------------------------------------------------------------

    async def acquire(
        self,
        model: str,
        limits: Limits,
        *,
        priority: int = 0,
        timeout_s: float | None = None,
        request_id: str | None = None,
        owner: str = "",
        weight: float = 1.0,
    ) -> Slot:
        """Wait for a slot of `model` under `limits` (the latest limits win for the model).

        Raises `QueueFull` at once when `limits.max_queue` requests already wait, `QueueTimeout`
        when `timeout_s` passes first. Cancelling the calling task leaves the queue cleanly.
        `request_id` (optional, unique among waiters) lets `position()` find this waiter.
        `owner` and its `weight` (> 0): whose request it is, for fair queuing (fair_share.py).
        """
        state = self._models.get(model)
        if state is None:
            state = self._models[model] = _ModelState(model, limits)
        else:
            state.limits = limits
            self._dispatch(state)  # max_concurrency may have grown
        now = self._clock()
        if state.running < limits.max_concurrency:
            # After _dispatch, a free slot means no live waiter is queued.
            state.fair.admitted(priority, state.fair.arrive(priority, owner, weight))
            state.running += 1
            state.admitted_total += 1
            state.owner(owner).running += 1
            state.avg_wait_s = _ewma(state.avg_wait_s, 0.0)
            metrics.queue_waited(model, 0.0)
            return Slot(self, state, now, owner)
        if state.queued >= limits.max_queue:
            state.rejected_total += 1
            retry = self.retry_after_s(model)
            raise QueueFull(
                f"model '{model}' is busy: {state.running} running, {state.queued} waiting "
                f"(max_queue {limits.max_queue}); retry in about {retry:.0f}s",
                model=model,
                retry_after_s=retry,
            )
        if timeout_s is not None and timeout_s <= 0:
            state.timed_out_total += 1
            raise self._timeout_error(state, timeout_s)

        loop = asyncio.get_running_loop()
        tag = state.fair.arrive(priority, owner, weight)
        waiter = _Waiter(loop.create_future(), priority, next(self._seq), now, request_id,
                         owner, tag)
        heapq.heappush(state.heap, (-priority, tag.start, waiter.seq, waiter))
        state.queued += 1
        state.owner(owner).queued += 1
        if request_id is not None:
            state.by_request_id[request_id] = waiter
        timer = (
            loop.call_later(timeout_s, self._expire, state, waiter, timeout_s)
            if timeout_s is not None
            else None
        )
        try:
            slot = await waiter.future
        except asyncio.CancelledError:
            self._abandon(state, waiter)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        state.admitted_total += 1
        granted_at = waiter.granted_at if waiter.granted_at is not None else self._clock()
        waited = max(0.0, granted_at - waiter.enqueued_at)
        state.avg_wait_s = _ewma(state.avg_wait_s, waited)
        metrics.queue_waited(model, waited)
        metrics.note_queue_wait(waited)
        return slot

    def _dispatch(self, state: _ModelState) -> None:
        """Hand free slots to the best live waiters; never awaits."""
        while state.running < state.limits.max_concurrency and state.heap:
            waiter = heapq.heappop(state.heap)[-1]
            if not waiter.live:
                state.dead -= 1
                continue
            self._unlink(state, waiter, popped=True)
            if waiter.future.done():
                # Cancelled, its task has not run its handler yet: it just leaves.
                state.cancelled_total += 1
                state.fair.withdrawn(waiter.priority, waiter.owner, waiter.tag)
                state.forget_idle(waiter.owner)
                continue
            state.fair.admitted(waiter.priority, waiter.tag)
            state.running += 1
            state.owner(waiter.owner).running += 1
            waiter.granted_at = self._clock()
            waiter.future.set_result(Slot(self, state, waiter.granted_at, waiter.owner))

    def _unlink(self, state: _ModelState, waiter: _Waiter, *, popped: bool) -> None:
        """Take a live waiter out of the counts (its heap entry goes lazily unless popped)."""
        waiter.live = False
        state.queued -= 1
        state.owner(waiter.owner).queued -= 1
        if waiter.request_id is not None and state.by_request_id.get(waiter.request_id) is waiter:
            del state.by_request_id[waiter.request_id]
        if not popped:
            state.dead += 1
            if state.dead >= _COMPACT_MIN_DEAD and state.dead * 2 > len(state.heap):
                state.heap = [entry for entry in state.heap if entry[-1].live]
                heapq.heapify(state.heap)
                state.dead = 0

    def _abandon(self, state: _ModelState, waiter: _Waiter) -> None:
        """The waiting task was cancelled: leave the queue, or pass on a slot already handed."""
        if waiter.live:
            self._unlink(state, waiter, popped=False)
            state.cancelled_total += 1
            state.fair.withdrawn(waiter.priority, waiter.owner, waiter.tag)
            state.forget_idle(waiter.owner)
            return
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            state.cancelled_total += 1
            future.result()._finish(record=False)  # goes to the next waiter
        # else: it timed out or _dispatch already counted it; nothing is held.

    def _expire(self, state: _ModelState, waiter: _Waiter, timeout_s: float) -> None:
        if not waiter.live or waiter.future.done():
            return  # granted or cancelled in the meantime: the grant (or the handler) wins
        self._unlink(state, waiter, popped=False)
        state.timed_out_total += 1
        state.fair.withdrawn(waiter.priority, waiter.owner, waiter.tag)
        state.forget_idle(waiter.owner)
        waiter.future.set_exception(self._timeout_error(state, timeout_s))

    def _timeout_error(self, state: _ModelState, timeout_s: float) -> QueueTimeout:
        retry = self.retry_after_s(state.name)
        return QueueTimeout(
            f"model '{state.name}' stayed busy for the queue timeout of {timeout_s:g}s "
            f"({state.running} running, {state.queued} waiting); retry in about {retry:.0f}s",
            model=state.name,
            retry_after_s=retry,
        )

    def _release(self, state: _ModelState, granted_at: float, owner: str, *,
                 record: bool) -> None:
        state.running -= 1
        state.owner(owner).running -= 1
        state.forget_idle(owner)
        if record:
            held = max(0.0, self._clock() - granted_at)
            state.avg_service_s = _ewma(state.avg_service_s, held)
        self._dispatch(state)

    # -- reports -----------------------------------------------------------------------------

    def retry_after_s(self, model: str) -> float:
        """Seconds until a retry would likely be admitted at once (see the module docstring)."""
        state = self._models.get(model)
        if state is None:
            return MIN_RETRY_AFTER_S
        service = state.avg_service_s if state.avg_service_s is not None else DEFAULT_SERVICE_S
        estimate = service * (state.queued + 1) / state.limits.max_concurrency
        return max(MIN_RETRY_AFTER_S, estimate)

    def queued(self, model: str) -> int:
        state = self._models.get(model)
        return 0 if state is None else state.queued

    def running(self, model: str) -> int:
        state = self._models.get(model)
        return 0 if state is None else state.running

    def owners(self, model: str) -> frozenset[str]:
        """Owners with requests of `model` running or waiting now."""
        state = self._models.get(model)
        return frozenset() if state is None else frozenset(state.owners)

    def position(self, model: str, request_id: str) -> int | None:
        """Waiters admitted before `request_id` as things stand (0 = next); None if not waiting."""
        state = self._models.get(model)
        waiter = None if state is None else state.by_request_id.get(request_id)
        if state is None or waiter is None or not waiter.live:
            return None
        return sum(1 for other in state.live_waiters() if other.key < waiter.key)

    def stats(self, model: str | None = None) -> dict[str, Any]:
        """One model's figures, or `{model: figures}` for every model seen when `model` is None."""
        if model is None:
            return {name: self._stats(state) for name, state in self._models.items()}
        state = self._models.get(model)
        if state is None:
            return {
                "running": 0,
                "queued": 0,
                "max_concurrency": None,
                "max_queue": None,
                "admitted_total": 0,
                "rejected_total": 0,
                "timed_out_total": 0,
                "cancelled_total": 0,
                "avg_wait_s": None,
                "avg_service_s": None,
                "longest_wait_s": 0.0,
                "retry_after_s": MIN_RETRY_AFTER_S,
                "owners": {},
            }
        return self._stats(state)

    def _stats(self, state: _ModelState) -> dict[str, Any]:
        now = self._clock()
        waiting = state.live_waiters()
        longest = max((now - w.enqueued_at for w in waiting), default=0.0)
        return {
            "running": state.running,
            "queued": state.queued,
            "max_concurrency": state.limits.max_concurrency,
            "max_queue": state.limits.max_queue,
            "admitted_total": state.admitted_total,
            "rejected_total": state.rejected_total,
            "timed_out_total": state.timed_out_total,
            "cancelled_total": state.cancelled_total,
            "avg_wait_s": state.avg_wait_s,
            "avg_service_s": state.avg_service_s,
            "longest_wait_s": max(0.0, longest),
            "retry_after_s": self.retry_after_s(state.name),
            # Owners with requests running or waiting: one entry each (bounded by demand).
            "owners": {name: {"running": f.running, "queued": f.queued}
                       for name, f in state.owners.items()},
        }
