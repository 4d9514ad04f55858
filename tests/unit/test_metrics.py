"""Metrics: the usage read from a whole answer, the usage event, the request middleware's
labels, the gauges computed from a canned engine /status, and the Grafana dashboard against the
metric definitions."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from modelyard import metrics
from modelyard.errors import ModelLoadFailed, ModelyardError, QueueFull, UpstreamError
from modelyard.front.ops.metrics import RequestMetrics, exposition, readings
from modelyard.wire.status import EngineReport

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

DOCS = Path(__file__).resolve().parents[2] / "docs"


# ---- the usage of a whole answer ---------------------------------------------------------------

OPENAI_JSON = (
    b'{"choices":[{"finish_reason":"stop","index":0,"message":{"role":"assistant","content":'
    b'"The quick brown fox"}}],"created":1,"model":"m","object":"chat.completion",'
    b'"usage":{"completion_tokens":16,"prompt_tokens":4,"total_tokens":20,'
    b'"prompt_tokens_details":{"cached_tokens":0}},"id":"x",'
    b'"timings":{"cache_n":0,"prompt_n":3,"prompt_ms":0.2,"predicted_n":15,"predicted_ms":9.1}}'
)
SSE_TIMINGS_ONLY = (
    b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"object":'
    b'"chat.completion.chunk","id":"x","timings":{"cache_n":0,"prompt_n":4,"prompt_ms":0.2,'
    b'"predicted_n":16,"predicted_ms":61.3}}\n\ndata: [DONE]\n\n'
)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (OPENAI_JSON, (4, 16, 0)),  # usage wins over timings
        (b'{"object":"list","data":[],"usage":{"prompt_tokens":9,"total_tokens":9}}', (9, 0, 0)),
        # llama-server's timings alone: prompt_n leaves out the cached tokens (cache_n)
        (b'{"content":"x","timings":{"cache_n":6,"prompt_n":3,"predicted_n":2}}', (9, 2, 6)),
        # usage without details: the cached ones from timings
        (b'{"usage":{"prompt_tokens":9,"completion_tokens":2},"timings":{"cache_n":6}}',
         (9, 2, 6)),
        # a huge answer: only its usage is decoded
        (b'{"content":"' + b"x" * 100_000 + b'","usage":{"prompt_tokens":1,'
         b'"completion_tokens":2}}', (1, 2, 0)),
    ],
)
def test_usage_in_a_whole_body(body: bytes, expected: tuple[int, int, int]) -> None:
    assert metrics.usage_in_body(body) == expected


@pytest.mark.parametrize("body", [b"", b'{"model":"m","done":true}', b'{"usage":null}',
                                  b'{"usage":{"prompt_tokens":'])
def test_no_usage_in_a_body(body: bytes) -> None:
    assert metrics.usage_in_body(body) in (None, (0, 0, 0))


# ---- the request middleware -------------------------------------------------------------------


def sample(name: str, **labels: str) -> float:
    metrics.fold()  # the request path's tally reaches the metric objects when they are read
    return REGISTRY.get_sample_value(name, labels) or 0.0


def events(*chunks: bytes) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    return gen()


async def _handler(request: Request) -> Response:
    """A stand-in for the APIs: what the hooks in state.route, Relay and the streams note."""
    case = request.query_params["case"]
    metrics.note_model(f"unit-{case}")
    if case == "queue_full":
        raise QueueFull("busy", retry_after_s=1.0)
    if case == "progress_then_load_failed":  # swap progress, then the load fails in-band
        failed = metrics.stream_failed(ModelLoadFailed("no"))
        return StreamingResponse(events(b"data: loading\n\n", b"data: " + failed.code.encode()))
    metrics.note_opened()
    if case == "json":
        metrics.note_usage(metrics.usage_in_body(OPENAI_JSON))  # what Relay.read reports
        return Response(OPENAI_JSON, media_type="application/json")
    if case == "stream":
        metrics.note_usage(metrics.Usage(4, 16, 0))  # the relay's usage event
        return StreamingResponse(events(b"data: first\n\n", SSE_TIMINGS_ONLY))

    async def broken() -> AsyncIterator[bytes]:
        yield b"data: first\n\n"
        yield metrics.counting_errors(lambda e: str(e).encode())(UpstreamError("broke"))

    return StreamingResponse(broken())


async def _on_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ModelyardError)
    return Response(b"{}", status_code=exc.status)


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = Starlette(routes=[Route("/v1/chat/completions", _handler, methods=["POST"])],
                    exception_handlers={ModelyardError: _on_error})
    return TestClient(RequestMetrics(app))


def counts(case: str, status: str) -> tuple[float, ...]:
    model = f"unit-{case}"
    return (
        sample("modelyard_requests_total", model=model, api="openai", status=status),
        sample("modelyard_time_to_first_token_seconds_count", model=model, api="openai"),
        sample("modelyard_request_duration_seconds_count", model=model, api="openai"),
        sample("modelyard_tokens_total", model=model, direction="in"),
        sample("modelyard_tokens_total", model=model, direction="out"),
    )


@pytest.mark.parametrize(
    ("case", "status", "delta"),
    [
        ("json", "200", (1, 0, 1, 4, 16)),  # a whole answer: no first token, its usage
        ("stream", "200", (1, 1, 1, 4, 16)),  # the usage event's
        ("queue_full", "429", (1, 0, 0, 0, 0)),
        ("broken", "upstream_error", (1, 1, 0, 0, 0)),  # a first token, then an in-band error
        ("progress_then_load_failed", "model_load_failed", (1, 0, 0, 0, 0)),
    ],
)
def test_each_request_is_counted_with_its_status_first_token_and_tokens(
    client: TestClient, case: str, status: str, delta: tuple[int, ...]
) -> None:
    before = counts(case, status)
    client.post(f"/v1/chat/completions?case={case}", json={})
    after = counts(case, status)
    assert tuple(a - b for a, b in zip(after, before, strict=True)) == delta


def test_other_routes_are_not_counted(client: TestClient) -> None:
    before = sample("modelyard_requests_total", model="", api="openai", status="404")
    assert client.get("/v1/models").status_code == 404
    assert sample("modelyard_requests_total", model="", api="openai", status="404") == before


def test_status_labels_of_requests_that_end_early() -> None:
    cut = metrics.Request("openai")
    cut.status = 200
    cut.on_body(b"data: x\n\n", True)
    assert cut._status_label(None) == "client_closed_request"  # the stream stopped short
    assert cut._status_label(OSError("gone")) == "client_closed_request"
    assert cut._status_label(UpstreamError("broke")) == "upstream_error"
    assert metrics.Request("openai")._status_label(RuntimeError("bug")) == "500"


def test_load_outcomes() -> None:
    from modelyard.errors import InsufficientMemory

    assert metrics.load_outcome(ModelLoadFailed("x")) == "failed"
    assert metrics.load_outcome(InsufficientMemory("x")) == "no_fit"
    assert metrics.load_outcome(TimeoutError()) == "failed"
    import asyncio

    assert metrics.load_outcome(asyncio.CancelledError()) == "cancelled"


# ---- readings from a canned /status -------------------------------------------------------------

GIB = 2**30
STATUSES: list[dict[str, Any]] = [  # GET /status's engines, as the front lists them
    {
        "name": "engine-0", "up": True, "engine": 0, "pid": 123, "paused": None,
        "device": {"kind": "cuda", "name": "NVIDIA H100", "total_bytes": 80 * GIB,
                   "used_bytes": 30 * GIB, "free_bytes": 50 * GIB, "temperature_c": 61,
                   "utilization_pct": 42, "reserved_loading_bytes": 0},
        "scheduler": {"loads": 3},
        "models": [
            {"model": "a", "state": "ready", "leases": 2,
             "memory": {"estimate_bytes": 5 * GIB, "reserved_bytes": 6 * GIB,
                        "measured_bytes": 5 * GIB + 1, "host_bytes": None}},
            {"model": "b", "state": "stopped", "leases": 0, "warm": "host",
             "memory": {"estimate_bytes": 7 * GIB, "reserved_bytes": None,
                        "measured_bytes": None, "host_bytes": 6 * GIB}},
        ],
    },
    {"name": "engine-1", "up": False, "error": "engine-1 is not available (down)"},
]
REPORTS = [EngineReport.from_json(s) for s in STATUSES]  # decoded as the front does


def scraped(families: list[Any]) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = exposition(families).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def test_each_device_of_a_group_has_its_own_series() -> None:
    two = dict(STATUSES[0])
    card = {"kind": "cuda", "name": "NVIDIA H100", "total_bytes": 80 * GIB,
            "used_bytes": 0, "free_bytes": 80 * GIB}
    two["devices"] = [{**card, "index": 0}, {**card, "index": 1, "used_bytes": GIB}]
    got = scraped(list(readings([EngineReport.from_json(two)], {}, {"queued": 0,
                                                                    "running": 0})))
    used = {dict(labels)["device"]: v for (n, labels), v in got.items()
            if n == "modelyard_device_memory_used_bytes"}
    assert used == {"gpu0 NVIDIA H100": 0, "gpu1 NVIDIA H100": GIB}


def test_readings_from_a_canned_status() -> None:
    queues = {"a": {"queued": 3, "running": 2}}
    got = scraped(list(readings(REPORTS, queues, {"queued": 1, "running": 0})))

    def value(name: str, **labels: str) -> float | None:
        return got.get((name, frozenset(labels.items())))

    assert value("modelyard_engine_up", engine="engine-0") == 1
    assert value("modelyard_engine_up", engine="engine-1") == 0
    where = {"engine": "engine-0", "device": "NVIDIA H100"}
    assert value("modelyard_device_memory_total_bytes", **where) == 80 * GIB
    assert value("modelyard_device_memory_used_bytes", **where) == 30 * GIB
    assert value("modelyard_device_memory_free_bytes", **where) == 50 * GIB
    assert value("modelyard_device_utilization_ratio", **where) == pytest.approx(0.42)
    assert value("modelyard_device_temperature_celsius", **where) == 61
    assert value("modelyard_engine_paused", engine="engine-0") == 0
    a = {"model": "a", "engine": "engine-0"}
    assert value("modelyard_model_loaded", **a) == 1
    assert value("modelyard_model_leases", **a) == 2
    assert value("modelyard_model_memory_estimated_bytes", **a) == 5 * GIB
    assert value("modelyard_model_memory_reserved_bytes", **a) == 6 * GIB
    assert value("modelyard_model_memory_measured_bytes", **a) == 5 * GIB + 1
    b = {"model": "b", "engine": "engine-0"}
    assert value("modelyard_model_loaded", **b) == 0
    assert value("modelyard_model_memory_measured_bytes", **b) is None  # unknown: absent
    assert value("modelyard_model_warm_bytes", **b) == 6 * GIB  # in the warm tier
    assert value("modelyard_model_warm_bytes", **a) == 0
    assert value("modelyard_queue_depth", model="a") == 3
    assert value("modelyard_requests_running", model="a") == 2
    assert value("modelyard_pull_jobs_active", status="queued") == 1
    # A down engine leaves nothing but engine_up 0: no stale device figure.
    assert not [k for k in got if ("engine", "engine-1") in k[1] and k[0] != "modelyard_engine_up"]


def test_every_reading_is_a_defined_gauge() -> None:
    for family in readings(REPORTS, {"a": {"queued": 0, "running": 0}}, {"queued": 0}):
        spec = metrics.SPEC_BY_NAME[family.name]
        assert spec.kind == "gauge" and not spec.recorded


# ---- definitions, docs and the Grafana dashboard ------------------------------------------


def test_names_carry_the_prefix_and_their_units() -> None:
    for spec in metrics.SPECS:
        assert spec.name.startswith(metrics.PREFIX), spec.name
        if spec.kind == "counter":
            assert spec.name.endswith("_total"), spec.name
        if spec.kind == "histogram":
            assert spec.name.endswith("_seconds"), spec.name
        if "memory" in spec.name:
            assert spec.name.endswith("_bytes"), spec.name


def test_docs_describe_every_metric() -> None:
    text = (DOCS / "metrics.md").read_text()
    missing = [name for name in metrics.names() if f"`{name}`" not in text]
    assert not missing


def dashboard_exprs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for v in node.values() for e in dashboard_exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in dashboard_exprs(v)]
    return []


def test_the_grafana_dashboard_uses_only_defined_metrics() -> None:
    board = json.loads((DOCS / "grafana-dashboard.json").read_text())
    assert board["title"] and board["uid"] and board["schemaVersion"] >= 30
    panels = board["panels"]
    assert len(panels) >= 12
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["type"] and panel["title"] and set(panel["gridPos"]) >= {"h", "w", "x", "y"}
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
    exprs = dashboard_exprs(panels)
    used = {re.sub(r"_(bucket|sum|count)$", "", name)
            for expr in exprs for name in re.findall(r"\bmodelyard_[a-z_]+", expr)}
    assert used and used <= metrics.names(), used - metrics.names()
    # Every kind of figure the dashboard promises is on it.
    for name in ("modelyard_requests_total", "modelyard_time_to_first_token_seconds",
                 "modelyard_request_duration_seconds", "modelyard_tokens_total",
                 "modelyard_queue_depth", "modelyard_queue_wait_seconds",
                 "modelyard_model_loads_total", "modelyard_model_evictions_total",
                 "modelyard_model_load_duration_seconds",
                 "modelyard_model_memory_estimated_bytes",
                 "modelyard_model_memory_measured_bytes", "modelyard_device_memory_used_bytes",
                 "modelyard_device_utilization_ratio", "modelyard_device_temperature_celsius",
                 "modelyard_engine_up", "modelyard_pull_bytes_total",
                 "modelyard_pull_jobs_total"):
        assert name in used, name


# ---- the request path's tally -----------------------------------------------------------------


def _histogram(name: str, model: str) -> dict[str, float]:
    return {s.name + "|" + s.labels.get("le", ""): s.value
            for s in REGISTRY.collect() if s.name == name
            for s in s.samples if s.labels.get("model") == model}


def test_a_folded_histogram_is_the_one_observed_value_by_value() -> None:
    """The tally writes a histogram's buckets and sum once per fold (prometheus_client's
    internal layout); the exposed series must be those of observing each value."""
    import prometheus_client as pc

    values = [0.0, 0.004, 0.005, 0.0051, 0.3, 2.5, 7.0, 121.0, 1e9]
    reference = pc.Histogram("tally_reference_seconds", "h", ["model"],
                             buckets=metrics.QUEUE_BUCKETS, registry=None)
    for value in values:
        reference.labels("ref").observe(value)
    for value in values:
        metrics.queue_waited("tallied", value)
    metrics.fold()
    want = {s.name.replace("tally_reference", "modelyard_queue_wait") + "|" +
            s.labels.get("le", ""): s.value
            for f in reference.collect() for s in f.samples
            if s.labels.get("model") == "ref" and not s.name.endswith("_created")}
    got = {k: v for k, v in _histogram("modelyard_queue_wait_seconds", "tallied").items()
           if "_created" not in k}
    assert got == want


async def test_the_tally_reaches_the_metrics_within_its_fold_time_and_at_every_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(metrics, "FOLD_S", 0.05)
    before = sample("modelyard_usage_requests_total", owner="o", model="tally-a")
    metrics.usage_counted("o", "tally-a", 3, 0, 2)
    waited = 0
    while REGISTRY.get_sample_value("modelyard_usage_requests_total",
                                    {"owner": "o", "model": "tally-a"}) in (None, before):
        assert waited < 200, "the tally was not folded within 10 s"
        await asyncio.sleep(0.05)  # polled: the fold is a timer on this loop, not an event
        waited += 1
    assert sample("modelyard_usage_tokens_total", owner="o", model="tally-a",
                  kind="completion") >= 2

    monkeypatch.setattr(metrics, "FOLD_S", 3600.0)
    metrics.usage_counted("o", "tally-b", 1, 0, 1)
    text = exposition([]).decode()  # a scrape folds first
    assert 'modelyard_usage_requests_total{model="tally-b",owner="o"} 1.0' in text
