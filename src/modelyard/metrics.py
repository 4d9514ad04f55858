"""modelyard's Prometheus metrics: every metric is defined here, once (docs/metrics.md).

Two kinds:

- **recorded** where things happen, through the small functions below: the front counts
  requests, time to first token, latency, tokens, queue waits and pulls; an engine counts its
  loads, evictions (with the reason) and crashes, and times its loads;
- **readings** (device memory, utilization, temperature, engine up, model memory, queue depth):
  computed by the front at scrape time from each engine's /status and its own queues
  (front/ops/metrics.py), so a dead engine's last reading never lingers.

Multiprocess: the front and its engine processes record into one directory of memory-mapped
files (prometheus_client's multiprocess mode, `PROMETHEUS_MULTIPROC_DIR`), and the front's
`GET /metrics` sums them. prometheus_client picks its storage when it is imported, so this
module imports it lazily, on the first record: the front calls `setup_multiprocess` before
that, and the engines it spawns inherit the variable. Without it (a unit test, an in-process
app) metrics live in prometheus_client's default registry.

Nothing here imports more than the standard library at import time (the front stays light).
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import contextvars
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

import orjson

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
E = TypeVar("E")
T = TypeVar("T")
PREFIX = "modelyard_"

# LLM answers take from tens of milliseconds (one token) to minutes (a long answer on a CPU).
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
QUEUE_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
LOAD_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

Kind = Literal["counter", "histogram", "gauge"]


@dataclass(frozen=True)
class Spec:
    """One metric: its exposed name, type, help, labels; `recorded` False: read at scrape."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    recorded: bool = True


SPECS: tuple[Spec, ...] = (
    # ---- front, recorded ----------------------------------------------------------------
    Spec("modelyard_requests_total", "counter",
         "Inference requests by model, API and status (the HTTP status, or the in-band error "
         "code of a stream that failed after it started; client_closed_request: the client "
         "left mid-answer).", ("model", "api", "status")),
    Spec("modelyard_time_to_first_token_seconds", "histogram",
         "Streamed answers: from the request's arrival (queue and load included) to the first "
         "chunk of the backend's answer.", ("model", "api"), LATENCY_BUCKETS),
    Spec("modelyard_request_duration_seconds", "histogram",
         "Answers with status 200: from the request's arrival to the answer's last byte.",
         ("model", "api"), LATENCY_BUCKETS),
    Spec("modelyard_tokens_total", "counter",
         "Tokens the backends reported (usage, Ollama counts, llama-server timings): "
         "direction in (prompt) or out (generated).", ("model", "direction")),
    Spec("modelyard_queue_wait_seconds", "histogram",
         "Time a request waited in its model's queue before it was admitted (0 if at once).",
         ("model",), QUEUE_BUCKETS),
    Spec("modelyard_session_turns_total", "counter",
         "Chat session turns stored, by model and cache: hit (the backend reported reused "
         "prompt tokens) or miss.", ("model", "cache")),
    Spec("modelyard_session_cached_tokens_total", "counter",
         "Prompt tokens the backends reused from cache in chat session turns.", ("model",)),
    Spec("modelyard_usage_tokens_total", "counter",
         "Tokens per owner (usage accounting): kind prompt (all prompt tokens), cached (of "
         "those, reused from the KV cache) or completion. `owner` is bounded: the names in "
         "usage_metric_owners, the first usage_metric_top_owners others, then other; "
         "anonymous callers are anonymous.", ("owner", "model", "kind")),
    Spec("modelyard_usage_requests_total", "counter",
         "Inference requests per owner (the same bounded `owner` label).", ("owner", "model")),
    Spec("modelyard_pull_bytes_total", "counter",
         "Bytes pull jobs downloaded (a resumed file counts only what was fetched again)."),
    Spec("modelyard_pull_jobs_total", "counter",
         "Pull jobs that ended, by final status (succeeded, failed, cancelled).", ("status",)),
    # ---- engine, recorded ---------------------------------------------------------------
    Spec("modelyard_model_loads_total", "counter",
         "Model loads by outcome: success, failed (the backend did not come up), no_fit "
         "(no eviction could make room), cancelled.", ("model", "engine", "outcome")),
    Spec("modelyard_model_evictions_total", "counter",
         "Models unloaded, by reason: memory (to make room for `for_model`), idle (keep_alive "
         "ran out), unload (asked: admin route, keep_alive 0), reload (its config changed).",
         ("model", "engine", "reason", "for_model")),
    Spec("modelyard_model_load_duration_seconds", "histogram",
         "Successful loads: from the decision to load (evictions included) to ready.",
         ("model", "engine"), LOAD_BUCKETS),
    Spec("modelyard_model_crashes_total", "counter",
         "Backends that exited on their own while loaded.", ("model", "engine")),
    Spec("modelyard_draft_tokens_total", "counter",
         "Speculative decoding: tokens the model's draft proposed (llama-server's count, read "
         "after requests).", ("model",)),
    Spec("modelyard_draft_accepted_total", "counter",
         "Speculative decoding: drafted tokens the model accepted (over "
         "modelyard_draft_tokens_total: the acceptance rate).", ("model",)),
    # ---- readings, computed at scrape time by the front ---------------------------------
    Spec("modelyard_engine_up", "gauge", "1 while the engine answers, else 0.", ("engine",),
         recorded=False),
    Spec("modelyard_engine_paused", "gauge", "1 while the engine is paused to cool down.",
         ("engine",), recorded=False),
    Spec("modelyard_device_memory_total_bytes", "gauge", "The engine's device memory.",
         ("engine", "device"), recorded=False),
    Spec("modelyard_device_memory_used_bytes", "gauge", "Device memory in use (all processes).",
         ("engine", "device"), recorded=False),
    Spec("modelyard_device_memory_free_bytes", "gauge", "Device memory free.",
         ("engine", "device"), recorded=False),
    Spec("modelyard_device_utilization_ratio", "gauge",
         "Device compute utilization, 0 to 1 (absent where the probe cannot read it).",
         ("engine", "device"), recorded=False),
    Spec("modelyard_device_temperature_celsius", "gauge", "Device temperature.",
         ("engine", "device"), recorded=False),
    Spec("modelyard_model_loaded", "gauge",
         "1 for a model that is ready on the engine, 0 for one it knows but has not loaded.",
         ("model", "engine"), recorded=False),
    Spec("modelyard_model_leases", "gauge", "Requests in flight on the model (engine leases).",
         ("model", "engine"), recorded=False),
    Spec("modelyard_model_warm_bytes", "gauge",
         "Host RAM a stopped model holds in the engine's warm tier (0: not warm).",
         ("model", "engine"), recorded=False),
    Spec("modelyard_model_memory_estimated_bytes", "gauge",
         "What the model's files say it needs (the estimate before any load).",
         ("model", "engine"), recorded=False),
    Spec("modelyard_model_memory_reserved_bytes", "gauge",
         "What the engine's ledger reserved for the loaded (or loading) model.",
         ("model", "engine"), recorded=False),
    Spec("modelyard_model_memory_measured_bytes", "gauge",
         "What the device shows the model's process holding now.", ("model", "engine"),
         recorded=False),
    Spec("modelyard_queue_depth", "gauge", "Requests waiting in the model's queue.",
         ("model",), recorded=False),
    Spec("modelyard_requests_running", "gauge",
         "Requests of the model admitted by its queue and not finished.", ("model",),
         recorded=False),
    Spec("modelyard_pull_jobs_active", "gauge", "Pull jobs queued or running now.",
         ("status",), recorded=False),
)

SPEC_BY_NAME = {spec.name: spec for spec in SPECS}


def names() -> frozenset[str]:
    return frozenset(SPEC_BY_NAME)


# ---- multiprocess setup ---------------------------------------------------------------------

_owned_dir: Path | None = None
_released = False


def setup_multiprocess(home: Path) -> bool:
    """Make this process (a front) and the engines it spawns record into a fresh directory,
    `$home/run/metrics-<pid>`, removed by `release_multiprocess` (the front's last act) or at
    exit; directories of fronts that are gone are removed first. Call it before anything
    records. Returns whether multiprocess mode is on: False when prometheus_client was imported
    before without it (then the default registry serves)."""
    global _owned_dir, _released
    if _owned_dir is not None:
        if _released:  # a second app in this process (tests): files open before are lost
            _owned_dir.mkdir(parents=True, exist_ok=True)
            _released = False
        return True
    if "prometheus_client" in sys.modules:
        return multiprocess_on()
    run = home / "run"
    _remove_stale(run)
    directory = run / f"metrics-{os.getpid()}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    os.environ[MULTIPROC_ENV] = str(directory)
    _owned_dir = directory
    atexit.register(shutil.rmtree, directory, True)
    return True


def release_multiprocess() -> None:
    """Remove this front's metrics directory once its engines have stopped. (An atexit hook
    would not run: the server ends by re-raising the SIGTERM it handled.)"""
    global _released
    if _owned_dir is not None and not _released:
        _released = True
        shutil.rmtree(_owned_dir, ignore_errors=True)


def _remove_stale(run: Path) -> None:
    import psutil

    for old in run.glob("metrics-*"):
        pid = old.name.removeprefix("metrics-")
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(old, ignore_errors=True)


def multiprocess_on() -> bool:
    """Whether prometheus_client (imported now if it was not) records to files."""
    from prometheus_client import values

    return bool(getattr(values.ValueClass, "_multiprocess", False)) and bool(
        os.environ.get(MULTIPROC_ENV))


def process_exited(pid: int | None) -> None:
    """An engine process is gone: drop its live gauges (its counters stay summed)."""
    if pid is None or not os.environ.get(MULTIPROC_ENV) or not multiprocess_on():
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


def child_env(env: dict[str, str]) -> dict[str, str]:
    """The environment for a backend child server: without our metrics directory (a vLLM
    there would write its own metrics into it)."""
    env.pop(MULTIPROC_ENV, None)
    return env


# ---- the metric objects, made on first use ----------------------------------------------------


class _Family:
    """A labelled metric with its children cached (no lock, no validation on the hot path)."""

    __slots__ = ("_children", "metric")

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def child(self, *labels: str) -> Any:
        found = self._children.get(labels)
        if found is None:
            if _released and _owned_dir is not None:  # recording after the front's end
                _owned_dir.mkdir(parents=True, exist_ok=True)
            made = self.metric.labels(*labels) if labels else self.metric
            found = self._children[labels] = made
        return found


_families: dict[str, _Family] | None = None


def _build() -> dict[str, _Family]:
    import prometheus_client as pc

    made: dict[str, _Family] = {}
    for spec in SPECS:
        if not spec.recorded:
            continue
        if spec.kind == "counter":
            metric: Any = pc.Counter(spec.name, spec.help, spec.labels)
        elif spec.kind == "histogram":
            metric = pc.Histogram(spec.name, spec.help, spec.labels, buckets=spec.buckets
                                  or pc.Histogram.DEFAULT_BUCKETS)
        else:
            metric = pc.Gauge(spec.name, spec.help, spec.labels, multiprocess_mode="livesum")
        made[spec.name] = _Family(metric)
    return made


def prepare() -> None:
    """Import prometheus_client and make the metric families now, at startup: done by the first
    record instead, it cost that request ~0.1 s (0.2 s on a busy machine) — a cold load's first
    token, measured by bench-proxy. Call it after `setup_multiprocess`, whose storage it fixes."""
    global _families
    if _families is None:
        _families = _build()


def family(name: str) -> _Family:
    global _families
    if _families is None:
        _families = _build()
    return _families[name]


def _child(name: str, *labels: str) -> Any:
    global _families
    if _families is None:
        _families = _build()
    return _families[name].child(*labels)


# ---- the request path's tally ------------------------------------------------------------------

# How long a front request's counts may wait before they reach the metric objects (a scrape
# folds them first; this bounds what another `serve --workers` worker's scrape misses).
FOLD_S = 1.0


class _Tally:
    """The request path's counts and observations, summed here and folded into the metric
    objects (prometheus_client's memory-mapped files in multiprocess mode) at most FOLD_S later
    and before every read (`fold`): a lock and a file write per label set and fold, instead of
    ten per request. Only the event loop's code records here (the front's requests)."""

    __slots__ = ("_due", "counts", "observed")

    def __init__(self) -> None:
        self.counts: dict[tuple[str, tuple[str, ...]], float] = {}
        self.observed: dict[tuple[str, tuple[str, ...]], list[float]] = {}
        self._due: asyncio.AbstractEventLoop | None = None  # the loop a fold is due on

    def inc(self, name: str, labels: tuple[str, ...], amount: float = 1.0) -> None:
        key = (name, labels)
        self.counts[key] = self.counts.get(key, 0.0) + amount
        self._soon()

    def observe(self, name: str, labels: tuple[str, ...], value: float) -> None:
        found = self.observed.get((name, labels))
        if found is None:
            self.observed[(name, labels)] = [value]
        else:
            found.append(value)
        self._soon()

    def _soon(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to wait on (a thread, a script): write through
            self.fold()
            return
        if self._due is not loop:  # (a fold due on a loop that closed since never comes)
            self._due = loop
            loop.call_later(FOLD_S, self.fold)

    def fold(self) -> None:
        self._due = None
        counts, self.counts = self.counts, {}
        observed, self.observed = self.observed, {}
        for (name, labels), amount in counts.items():
            _child(name, *labels).inc(amount)
        for (name, labels), values in observed.items():
            _observe_all(_child(name, *labels), values)


def _observe_all(histogram: Any, values: list[float]) -> None:
    """`histogram.observe` for each of `values`, writing each bucket and the sum once:
    prometheus_client keeps a histogram's buckets uncumulated, one value per upper bound."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:  # another prometheus_client layout: the public way
            histogram.observe(value)
        return
    counts = [0] * len(bounds)
    for value in values:
        counts[bisect.bisect_left(bounds, value)] += 1  # the first bound >= value
    total.inc(math.fsum(values))
    for bucket, count in zip(buckets, counts, strict=True):
        if count:
            bucket.inc(count)


_TALLY = _Tally()


def fold() -> None:
    """Write what the request path counted to the metric objects (before reading them)."""
    _TALLY.fold()


atexit.register(fold)


# ---- engine records ---------------------------------------------------------------------------

LoadOutcome = Literal["success", "failed", "no_fit", "cancelled"]


def engine_name(index: int) -> str:
    return f"engine-{index}"


def model_loaded(model: str, engine: int, outcome: str, duration_s: float | None = None) -> None:
    """A load ended: `outcome` (LoadOutcome); a success's duration goes to the histogram."""
    name = engine_name(engine)
    _child("modelyard_model_loads_total", model, name, outcome).inc()
    if duration_s is not None:
        _child("modelyard_model_load_duration_seconds", model, name).observe(duration_s)


def load_outcome(exc: BaseException) -> str:
    """The outcome label of a load that raised `exc`."""
    from modelyard.errors import InsufficientMemory, ModelLoadFailed

    if isinstance(exc, ModelLoadFailed):
        return "failed"
    if isinstance(exc, InsufficientMemory):
        return "no_fit"
    return "failed" if isinstance(exc, Exception) else "cancelled"


def model_evicted(model: str, engine: int, reason: str, for_model: str | None) -> None:
    """`model` was unloaded: for `for_model` (memory), or for `reason` (idle, unload, reload)."""
    why = "memory" if for_model else reason
    _child("modelyard_model_evictions_total", model, engine_name(engine), why,
           for_model or "").inc()


def model_crashed(model: str, engine: int) -> None:
    _child("modelyard_model_crashes_total", model, engine_name(engine)).inc()


def draft_counted(model: str, drafted: int, accepted: int) -> None:
    if drafted > 0:
        _child("modelyard_draft_tokens_total", model).inc(drafted)
    if accepted > 0:
        _child("modelyard_draft_accepted_total", model).inc(accepted)


# ---- front records ----------------------------------------------------------------------------


def queue_waited(model: str, seconds: float) -> None:
    _TALLY.observe("modelyard_queue_wait_seconds", (model,), seconds)


def session_turn(model: str, cached_tokens: int | None) -> None:
    _child("modelyard_session_turns_total", model, "hit" if cached_tokens else "miss").inc()
    if cached_tokens:
        _child("modelyard_session_cached_tokens_total", model).inc(cached_tokens)


def usage_counted(owner: str, model: str, prompt: int, cached: int, completion: int) -> None:
    """One finished request in the usage families (`owner` already bounded by the caller)."""
    _TALLY.inc("modelyard_usage_requests_total", (owner, model))
    for kind, n in (("prompt", prompt), ("cached", cached), ("completion", completion)):
        if n:
            _TALLY.inc("modelyard_usage_tokens_total", (owner, model, kind), n)


def pull_fetched(nbytes: int) -> None:
    if nbytes > 0:
        _child("modelyard_pull_bytes_total").inc(nbytes)


def pull_finished(status: str) -> None:
    _child("modelyard_pull_jobs_total", status).inc()


class Observer:
    """A feature that follows requests through their events (`Request.observers`): each method
    is a no-op here; a subscriber overrides the ones it needs. Events are plain method calls on
    the event loop, a few per request: they must not await, do I/O or raise."""

    __slots__ = ()

    def admitted(self, request: Request) -> None:
        """The caller passed auth and its limits; the route runs next."""

    def leased(self, request: Request) -> None:
        """A backend's answer has begun under a lease (`request.model` is set)."""

    def first_byte(self, request: Request) -> None:
        """The first byte of a successful answer went to the client."""

    def usage(self, request: Request) -> None:
        """The backend reported the answer's tokens (`tokens_in`, `tokens_out`,
        `cached_tokens`); a later report replaces an earlier one."""

    def ended(self, request: Request) -> None:
        """The response is over: `status_label` says how (200, an error, the client left)."""


class _Prometheus(Observer):
    """The metrics' own subscriber: counts and times each request once it ended."""

    __slots__ = ()

    def ended(self, request: Request) -> None:
        model, api, status = request.model, request.api, request.status_label
        _TALLY.inc("modelyard_requests_total", (model, api, status))
        if request.first_at is not None:
            _TALLY.observe("modelyard_time_to_first_token_seconds", (model, api),
                           request.first_at - request.started)
        if status != "200":
            return
        _TALLY.observe("modelyard_request_duration_seconds", (model, api),
                       request.ended - request.started)
        if request.tokens_in:
            _TALLY.inc("modelyard_tokens_total", (model, "in"), request.tokens_in)
        if request.tokens_out:
            _TALLY.inc("modelyard_tokens_total", (model, "out"), request.tokens_out)


PROMETHEUS = _Prometheus()


class Request:
    """One inference request's record, made by the front's edge (front/ops/metrics.py) and
    filled by its events: the relay and the handlers deeper down reach it through `current`
    (`note_*`, `Relay`), and every feature that follows requests subscribes to its
    `observers` (the metrics here, the request log's sinks — usage, activity, limits — through
    front/ops/metrics.py). Nothing reads the answer's bytes for it: its tokens are the
    backend's own usage, reported by the relay (`on_usage`)."""

    __slots__ = (
        "answered_at",
        "api",
        "cached_tokens",
        "complete",
        "ended",
        "error",
        "first_at",
        "model",
        "observers",
        "opened",
        "queue_wait_s",
        "started",
        "status",
        "status_label",
        "swapped",
        "tokens_in",
        "tokens_out",
    )

    def __init__(self, api: str) -> None:
        self.api = api
        self.started = time.perf_counter()
        self.model = ""  # the catalog id once routed; "" for a request that never got there
        self.opened = False  # the backend's answer has begun (chunks before it: swap progress)
        self.status = 0
        self.first_at: float | None = None
        self.error: str | None = None  # in-band error code of a stream that broke
        self.complete = False
        self.observers: list[Observer] = [PROMETHEUS]
        # What the events brought, for the request's record (front/ops/request_log.py).
        self.queue_wait_s = 0.0  # time spent in the model's queue
        self.swapped = False  # the request waited for its model to be loaded
        self.tokens_in = 0  # every prompt token, the cached ones included
        self.tokens_out = 0
        self.cached_tokens = 0  # of tokens_in, those reused from the KV cache
        self.status_label = ""
        self.ended = 0.0
        # The first body byte of a successful answer (a whole JSON answer's TTFT is its
        # latency; `first_at`, for the metric, counts streams only).
        self.answered_at: float | None = None

    # ---- events ---------------------------------------------------------------------------

    def on_admitted(self) -> None:
        for observer in self.observers:
            observer.admitted(self)

    def on_leased(self) -> None:
        self.opened = True  # the next chunk the client gets is the first token
        for observer in self.observers:
            observer.leased(self)

    def on_body(self, body: bytes, more: bool) -> None:
        if body and self.answered_at is None and self.opened and self.status < 400:
            self.answered_at = time.perf_counter()
            if more:
                self.first_at = self.answered_at
            for observer in self.observers:
                observer.first_byte(self)
        if not more:
            self.complete = True

    def on_usage(self, usage: Usage) -> None:
        self.tokens_in, self.tokens_out, self.cached_tokens = usage
        for observer in self.observers:
            observer.usage(self)

    def finish(self, exc: BaseException | None = None) -> None:
        """The response is over (or raised `exc`): its status, then the `ended` event."""
        self.status_label = self._status_label(exc)
        self.ended = time.perf_counter()
        if self.status_label != "200" or self.api == "service":
            # Only an answer that ended well counts its tokens (a broken one's are unknown).
            self.tokens_in = self.tokens_out = self.cached_tokens = 0
        for observer in self.observers:
            observer.ended(self)

    def _status_label(self, exc: BaseException | None) -> str:
        if self.error is not None:
            return self.error
        if exc is None:
            if self.complete:
                return str(self.status)
            return "client_closed_request"  # the stream stopped short: the client went away
        if not self.status:
            return "500"  # nothing was sent: the server's error handler answers 500
        code = getattr(exc, "code", None)
        if isinstance(code, str):
            return code
        if isinstance(exc, OSError) or not isinstance(exc, Exception) or \
                type(exc).__name__ == "ClientDisconnect":
            return "client_closed_request"
        return "internal_error"


current: contextvars.ContextVar[Request | None] = contextvars.ContextVar(
    "modelyard_request", default=None)


def note_model(model: str) -> None:
    """The request being served was routed to catalog model `model`."""
    request = current.get()
    if request is not None:
        request.model = model


def note_queue_wait(seconds: float) -> None:
    """The request being served waited `seconds` in its model's queue."""
    request = current.get()
    if request is not None:
        request.queue_wait_s += seconds


def note_swap() -> None:
    """The request being served waited for its model to be loaded (a swap it caused or joined)."""
    request = current.get()
    if request is not None:
        request.swapped = True


def note_opened() -> None:
    """The backend's answer has begun under a lease (the `leased` event): the next chunk sent
    is the first token."""
    request = current.get()
    if request is not None:
        request.on_leased()


def note_usage(usage: Usage | None) -> None:
    """The backend reported the answer's tokens (the `usage` event); None: it did not."""
    if usage is not None:
        request = current.get()
        if request is not None:
            request.on_usage(usage)


def stream_failed(exc: E) -> E:
    """A stream that had started ends with an in-band error `exc` (returned unchanged)."""
    request = current.get()
    if request is not None:
        request.error = str(getattr(exc, "code", "internal_error"))
    return exc


def counting_errors(render: Callable[[E], T]) -> Callable[[E], T]:
    """`render` (an in-band error's bytes) that also notes the error as the request's end."""

    def rendered(exc: E) -> T:
        return render(stream_failed(exc))

    return rendered


# ---- the backend's usage ------------------------------------------------------------------


class Usage(NamedTuple):
    """An answer's tokens as its backend reported them: every prompt token (the cached ones
    included), the generated ones, and of the prompt's those reused from the KV cache."""

    prompt: int
    completion: int
    cached: int


def usage_of(event: dict[str, Any]) -> Usage | None:
    """The usage a backend's answer (or final stream event) reports, or None: OpenAI's
    `usage` (with `prompt_tokens_details.cached_tokens`), else llama-server's `timings`
    (`prompt_n` counts only the prompt tokens evaluated now, `cache_n` those reused), else its
    native completion's `tokens_evaluated`/`tokens_predicted`."""
    usage = event.get("usage")
    timings = event.get("timings")
    if not isinstance(timings, dict):
        timings = None
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
        if not cached and timings is not None:
            cached = _count(timings.get("cache_n"))
        return Usage(_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")),
                     cached)
    if timings is not None:
        cached = _count(timings.get("cache_n"))
        return Usage(_count(timings.get("prompt_n")) + cached,
                     _count(timings.get("predicted_n")), cached)
    if "tokens_predicted" in event:
        return Usage(_count(event.get("tokens_evaluated")), _count(event.get("tokens_predicted")),
                     0)
    return None


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


_DECODER = json.JSONDecoder()


# Up to this size an answer is decoded whole (orjson, at once); a larger one (an embedding's
# vectors) only from its `usage` and `timings` objects on.
_WHOLE_BODY_BYTES = 16_384


def usage_in_body(body: bytes) -> Usage | None:
    """The usage of a whole JSON answer, read once: only its `usage` and `timings` objects
    are decoded (found from the end, where backends put them), not the answer around them (an
    embedding's vectors), unless it is small."""
    if len(body) <= _WHOLE_BODY_BYTES:
        try:
            answer = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        return usage_of(answer) if isinstance(answer, dict) else None
    found: dict[str, Any] = {}
    for key in (b'"usage":', b'"timings":'):
        at = body.rfind(key)
        if at < 0:
            continue
        try:
            text = body[at + len(key):].decode()
            value, _ = _DECODER.raw_decode(text, len(text) - len(text.lstrip()))
        except (UnicodeDecodeError, ValueError):
            continue
        found[key[1:-2].decode()] = value
    return usage_of(found) if found else None
