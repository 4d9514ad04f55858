"""`GET /metrics` (Prometheus text format) and what feeds it in the front (docs/metrics.md).

- `Metered` (run by the front's edge, front/api/edge.py) makes each inference request's record
  (`modelyard.metrics.Request`), which its events fill: the relay and handlers deeper down
  reach it through `modelyard.metrics.current` (the model routed to, the lease, the backend's
  usage, an in-band error); nothing of the answer's bytes is read for it. When the response is
  over, the metrics count it (model/API/status, time to first token, latency, tokens) and the
  request log gets its record.
- `readings` turns each engine's /status (as `GET /status` shows it), the front's queues and
  its pull jobs into gauges at scrape time, so nothing stale outlives an engine.
- `metrics` answers the scrape: in multiprocess mode the sum of every process's files (front
  and engines, dead ones' counters included) plus the front's process figures; else the
  default registry. /metrics is an inference route (open on loopback with auth `auto`, any
  valid token elsewhere: scrapers seldom hold an admin token), so user names in an `owner`
  label are shown only to a caller with the admin scope; others get each name's keyed
  pseudonym (`Auth.pseudonym`), stable across scrapes, restarts and fronts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelyard import metrics as m
from modelyard.front.identity.principal import principal_of
from modelyard.front.ops import activity_capture
from modelyard.front.ops.activity import Activity
from modelyard.front.ops.activity_capture import Capture
from modelyard.front.ops.request_log import RequestLog, RequestRecord, wall_clock_of
from modelyard.front.state import FrontState, state_of
from modelyard.request_ids import REQUEST_ID
from modelyard.wire.status import EngineReport

# The inference routes and the API each belongs to (the `api` label).
API_OF_PATH = {
    "/v1/chat/completions": "openai",
    "/v1/completions": "openai",
    "/v1/responses": "openai",  # the Responses API (POST; its GET/DELETE paths carry an id)
    "/v1/messages": "anthropic",
    "/api/chat": "ollama",
    "/api/generate": "ollama",
    "/chat": "native",
    "/v1/audio/speech": "service",
    "/v1/audio/transcriptions": "service",
    "/v1/images/generations": "service",
    "/v1/embeddings": "embeddings",
    "/api/embed": "embeddings",
    "/api/embeddings": "embeddings",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
}


class Metered(m.Observer):
    """One inference request being counted and timed (the edge's part of the metrics, in
    front/api/edge.py): `start` when it arrives, `on_send` for each message of its answer,
    `finish` when its response is over. Its record (`modelyard.metrics.Request`) is filled by
    the request's events; this subscribes to its end, to hand the record to the request log
    (usage, activity, limits), and the activity view subscribes while it is in flight."""

    __slots__ = ("activity", "capture", "front", "request", "scope", "token")

    def __init__(self, scope: Scope, api: str) -> None:
        self.scope = scope
        self.request = m.Request(api)
        self.token = m.current.set(self.request)
        self.request.observers.append(self)
        # The activity view (front/ops/activity.py): what is in flight, and opt-in capture of
        # the bodies, taken here where they pass anyway; off, it costs an attribute read.
        self.front = _front_of(scope)
        self.activity: Activity | None = getattr(getattr(self.front, "ops", None), "activity",
                                                 None)
        self.capture: Capture | None = None
        if self.activity is not None:
            self.activity.begin(self.request, scope, REQUEST_ID.get())
            self.capture = activity_capture.begin(scope)

    @staticmethod
    def start(scope: Scope) -> Metered | None:
        """A Metered for an inference request (a POST to one of API_OF_PATH), else None."""
        api = API_OF_PATH.get(scope["path"])
        return None if api is None or scope["method"] != "POST" else Metered(scope, api)

    def receive(self, receive: Receive) -> Receive:
        """`receive`, copying the body when the activity view captures it."""
        return receive if self.capture is None else self.capture.wrap(receive)

    def on_send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            self.request.on_body(message.get("body", b""), message.get("more_body", False))
            if self.capture is not None:
                self.capture.on_response(message.get("body", b""))
        elif kind == "http.response.start":
            self.request.status = message["status"]

    def ended(self, request: m.Request) -> None:
        _record(self.front, self.scope, request, self.capture)

    def finish(self, exc: BaseException | None = None) -> None:
        """The request's end (its `ended` event); `exc`: what ended it, if it raised."""
        try:
            self.request.finish(exc)
        finally:
            m.current.reset(self.token)
            if self.activity is not None:
                self.activity.end(self.request)


class RequestMetrics:
    """`Metered` as an ASGI middleware of its own, for an app without the front's edge (the
    request log's and activity view's unit tests mount it around a bare app)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        metered = Metered.start(scope) if scope["type"] == "http" else None
        if metered is None:
            await self.app(scope, receive, send)
            return

        async def watched(message: Message) -> None:
            metered.on_send(message)
            await send(message)

        try:
            await self.app(scope, metered.receive(receive), watched)
        except BaseException as exc:
            metered.finish(exc)
            raise
        metered.finish()


def _front_of(scope: Scope) -> FrontState | None:
    """The front's state, looked up once per request; None for an app without one (tests
    mounting the middleware alone)."""
    front: FrontState | None = getattr(getattr(scope.get("app"), "state", None), "front", None)
    return front


def _record(front: FrontState | None, scope: Scope, request: m.Request,
            capture: Capture | None = None) -> None:
    """Hand the finished request to the front's request log (usage, activity), if any sink
    listens."""
    log: RequestLog | None = getattr(getattr(front, "ops", None), "requests", None)
    if log is None or not log.active:
        return
    principal = scope.get("modelyard.principal")
    if capture is not None:
        activity_capture.finish(front, capture, principal, scope["path"], request)
    first = request.first_at if request.first_at is not None else request.answered_at
    log.emit(RequestRecord(
        request_id=REQUEST_ID.get(),
        started_at=wall_clock_of(request.started),
        user=getattr(principal, "user", None),
        token_id=getattr(principal, "token_id", None),
        api=request.api,
        path=scope["path"],
        model=request.model,
        status=request.status_label,
        prompt_tokens=request.tokens_in,
        cached_tokens=request.cached_tokens,
        completion_tokens=request.tokens_out,
        ttft_s=None if first is None else first - request.started,
        duration_s=request.ended - request.started,
        queue_wait_s=request.queue_wait_s,
        swapped=request.swapped,
        batch_id=scope.get("modelyard.batch_id"),
        streamed=request.first_at is not None,
    ))


# ---- readings ---------------------------------------------------------------------------------


def readings(
    statuses: Iterable[EngineReport],
    queues: dict[str, dict[str, Any]],
    pulls: dict[str, int],
) -> Iterator[Any]:
    """Gauge families for the scrape: engines (from their /status), the front's queues, pulls."""
    from prometheus_client.core import GaugeMetricFamily

    made: dict[str, GaugeMetricFamily] = {}

    def add(name: str, labels: Iterable[str], value: float | None) -> None:
        if value is None:
            return
        family = made.get(name)
        if family is None:
            spec = m.SPEC_BY_NAME[name]
            family = made[name] = GaugeMetricFamily(name, spec.help, labels=spec.labels)
        family.add_metric(list(labels), float(value))

    for report in statuses:
        name = report.name
        add("modelyard_engine_up", [name], 1 if report.up else 0)
        reported = report.status
        if reported is None:
            continue
        add("modelyard_engine_paused", [name], 1 if reported.paused else 0)
        # One series per device of the engine's group (an engine that reports no split: its
        # one device); two cards of one model have one name, so several are told apart by
        # their index.
        several = len(reported.devices) > 1
        for device in reported.devices or (reported.device,):
            label = device.name or ""
            where = [name, f"gpu{device.index} {label}" if several else label]
            add("modelyard_device_memory_total_bytes", where, device.total_bytes)
            add("modelyard_device_memory_used_bytes", where, device.used_bytes)
            add("modelyard_device_memory_free_bytes", where, device.free_bytes)
            util = device.utilization_pct
            add("modelyard_device_utilization_ratio", where,
                None if util is None else util / 100)
            add("modelyard_device_temperature_celsius", where, device.temperature_c)
        for held in reported.models:
            which = [held.model, name]
            add("modelyard_model_loaded", which, 1 if held.state == "ready" else 0)
            add("modelyard_model_leases", which, held.leases)
            warm = held.memory.host_bytes if held.warm else 0
            add("modelyard_model_warm_bytes", which, warm)
            memory = held.memory
            add("modelyard_model_memory_estimated_bytes", which, memory.estimate_bytes)
            add("modelyard_model_memory_reserved_bytes", which, memory.reserved_bytes)
            add("modelyard_model_memory_measured_bytes", which, memory.measured_bytes)
    for model, figures in queues.items():
        add("modelyard_queue_depth", [model], figures.get("queued"))
        add("modelyard_requests_running", [model], figures.get("running"))
    for status, count in pulls.items():
        add("modelyard_pull_jobs_active", [status], count)
    yield from made.values()


class _Readings:
    """A collector of families computed before the scrape."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


def family_name(spec: m.Spec) -> str:
    """The name a family is exposed and parsed under (prometheus_client drops a counter's
    `_total`, which its samples carry)."""
    return spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name


def placeholders(present: set[str]) -> Iterator[Any]:
    """Every family of `metrics.SPECS` not in `present`, described and without samples (a
    labelled family has no series before its first label set) or at 0 (an unlabelled one): a
    fresh server exposes the whole catalogue, so dashboards and alerts on a rate see 0, not
    "no data"."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    for spec in m.SPECS:
        if family_name(spec) in present:
            continue
        labels = list(spec.labels)
        if spec.kind == "counter":
            yield CounterMetricFamily(spec.name, spec.help, None if labels else 0.0,
                                      labels=labels or None)
        elif spec.kind == "gauge":
            yield GaugeMetricFamily(spec.name, spec.help, None if labels else 0.0,
                                    labels=labels or None)
        else:
            yield HistogramMetricFamily(spec.name, spec.help, labels=labels or None)


# The `owner` values that are no user's name: the groups OwnerLabels (ops/usage.py) puts callers in.
OWNER_GROUPS = frozenset({"anonymous", "other"})


def pseudonymize(families: Iterable[Any], pseudonym: Callable[[str], str]) -> None:
    """Replace, in place, each user name in an `owner` label with `pseudonym(name)`."""
    for family in families:
        family.samples = [
            s._replace(labels={**s.labels, "owner": pseudonym(s.labels["owner"])})
            if s.labels.get("owner") not in (None, *OWNER_GROUPS) else s
            for s in family.samples
        ]


def exposition(families: list[Any], pseudonym: Callable[[str], str] | None = None) -> bytes:
    """The text format of every recorded metric (all processes'), of `families`, and of every
    other family metrics.py defines (see `placeholders`); with `pseudonym`, owners' names are
    replaced by it (a scraper without the admin scope)."""
    from prometheus_client import REGISTRY, CollectorRegistry, ProcessCollector, generate_latest

    m.fold()  # this process's tally of recent requests, written before anything is read
    m.family("modelyard_requests_total")  # every recorded family exists, so each is described
    source = REGISTRY
    if m.multiprocess_on():
        from prometheus_client import multiprocess

        source = CollectorRegistry(auto_describe=False)
        multiprocess.MultiProcessCollector(  # type: ignore[no-untyped-call]
            source, os.environ[m.MULTIPROC_ENV])
        ProcessCollector(registry=source)  # the front's own CPU and memory
    collected = [*source.collect(), *families]
    if pseudonym is not None:  # every collect() builds fresh families: changing them is safe
        pseudonymize(collected, pseudonym)
    collected += placeholders({family.name for family in collected})
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Readings(collected))
    return generate_latest(registry)


async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    state: FrontState = state_of(request)
    statuses = await state.dispatch.engine_statuses()
    pulls = state.catalog.jobs.active()
    families = list(readings(statuses, state.dispatch.queues.stats(), pulls))
    admin = principal_of(request).can("admin")
    body = exposition(families, None if admin else state.identity.auth.pseudonym)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


routes = [Route("/metrics", metrics, methods=["GET"])]
