"""GET /metrics through a real `modelyard serve`: with its engine in a separate process (the
front sums both processes' files) and with --single-process. Fake models on a simulated 8 GiB
GPU: requests through the three APIs, a queue_full 429, a load, an eviction to make room and an
asked-for unload, device and model memory, engine_up — and, multi-process, an engine killed
and seen down while its counters stay. A pull from the fake Hub counts its bytes and its job.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.fakes.hub_repos import HubServer
from tests.integration.harness import APIS, chat_request, config, status
from tests.integration.pull_support import hub_env, quant_repo, running_server, submit, wait_job
from tests.integration.test_scheduling import GIB, sim_config, sim_model
from tests.support import Server, poll

from modelyard import metrics
from modelyard.front.ops.metrics import family_name

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
PROMPT_TOKENS, ANSWER_TOKENS = 4, 16  # the fake's usage for harness.HELLO, no max_tokens


def scrape(server: Server) -> Samples:
    r = httpx.get(server.url + "/metrics", headers=server.admin_headers, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text) for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def matching(samples: Samples, name: str, **labels: str) -> list[float]:
    """Values of `name` whose labels include `labels` (others may differ)."""
    want = set(labels.items())
    return [v for (n, have), v in samples.items() if n == name and want <= have]


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


@pytest.fixture
def models(tmp_path: Path) -> list[dict[str, Any]]:
    files = tmp_path / "files"
    files.mkdir()
    return [
        sim_model("a", 5, files),
        sim_model("b", 5, files),  # a and b do not fit together: b evicts a
        sim_model("q", 0.5, files, "--tokens-per-s", "20", max_concurrency=1, max_queue=0),
    ]


@pytest.mark.parametrize("mode", ["engine-process", "single-process"])
def test_metrics_count_requests_loads_evictions_and_read_the_engines(
    tmp_path: Path, models: list[dict[str, Any]], mode: str
) -> None:
    args = ("--single-process",) if mode == "single-process" else ()
    # A killed engine stays down long enough to be seen down.
    cfg = sim_config(*models, engine_restart_backoff_s=30)
    server = Server(tmp_path / "front", cfg, *args)
    try:
        server.wait_healthy()
        check_requests_and_tokens(server)
        check_queue_full(server)
        check_loads_evictions_and_readings(server)
        engine_pid = status(server)["engines"][0]["pid"]
        if mode == "single-process":
            assert engine_pid == server.proc.pid
        else:
            assert engine_pid != server.proc.pid  # what it recorded came from another process
            check_a_killed_engine_reads_down(server, engine_pid)
    finally:
        server.stop()


def check_requests_and_tokens(server: Server) -> None:
    for api in APIS:
        for stream in (False, True):
            path, body = chat_request(api, "a", stream=stream)
            r = post(server, path, body)
            assert r.status_code == 200, r.text
            assert "error" not in r.text
    s = scrape(server)
    for api in APIS:
        assert value(s, "modelyard_requests_total", model="a", api=api, status="200") == 2
        # Only the streamed answer has a first token; both have a duration.
        assert value(s, "modelyard_time_to_first_token_seconds_count", model="a", api=api) == 1
        assert value(s, "modelyard_request_duration_seconds_count", model="a", api=api) == 2
    n = 2 * len(APIS)
    assert value(s, "modelyard_tokens_total", model="a", direction="in") == n * PROMPT_TOKENS
    assert value(s, "modelyard_tokens_total", model="a", direction="out") == n * ANSWER_TOKENS
    assert value(s, "modelyard_queue_wait_seconds_count", model="a") == n
    assert value(s, "modelyard_time_to_first_token_seconds_sum", model="a", api="openai") > 0


def check_queue_full(server: Server) -> None:
    """q serves one request at a time and lets none wait: a second one while the first streams
    is refused with 429, and counted so."""
    path, body = chat_request("openai", "q", stream=True)
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # it holds q now
        refused = post(server, path, {**body, "stream": False})
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "queue_full"
        for _ in lines:
            pass
    s = scrape(server)
    assert value(s, "modelyard_requests_total", model="q", api="openai", status="429") == 1
    assert value(s, "modelyard_requests_total", model="q", api="openai", status="200") == 1
    unknown = post(server, "/api/chat", {"model": "nope", "messages": [], "stream": False})
    assert unknown.status_code == 404
    s = scrape(server)
    assert value(s, "modelyard_requests_total", model="", api="ollama", status="404") == 1


def check_loads_evictions_and_readings(server: Server) -> None:
    path, body = chat_request("openai", "b", stream=False)
    assert post(server, path, body).status_code == 200  # loads b, evicting a to make room
    r = httpx.post(server.url + "/admin/models/b/unload", headers=server.admin_headers,
                   timeout=60)
    assert r.status_code == 200, r.text
    s = scrape(server)
    engine = {"engine": "engine-0"}
    for model in ("a", "b", "q"):
        assert value(s, "modelyard_model_loads_total", model=model, outcome="success",
                     **engine) == 1
        assert value(s, "modelyard_model_load_duration_seconds_count", model=model,
                     **engine) == 1
    assert value(s, "modelyard_model_evictions_total", model="a", reason="memory",
                 for_model="b", **engine) == 1
    assert value(s, "modelyard_model_evictions_total", model="b", reason="unload",
                 for_model="", **engine) == 1
    # Readings: the device, what q (still loaded) reserved and holds, the engine.
    assert matching(s, "modelyard_device_memory_total_bytes", **engine) == [8 * GIB]
    assert matching(s, "modelyard_device_memory_used_bytes", **engine) == [GIB // 2]
    assert matching(s, "modelyard_device_memory_free_bytes", **engine) == [8 * GIB - GIB // 2]
    q = {"model": "q", **engine}
    assert value(s, "modelyard_model_loaded", **q) == 1
    assert value(s, "modelyard_model_loaded", model="a", **engine) == 0
    assert value(s, "modelyard_model_memory_reserved_bytes", **q) == GIB // 2
    assert value(s, "modelyard_model_memory_measured_bytes", **q) == GIB // 2
    assert value(s, "modelyard_engine_up", **engine) == 1
    assert value(s, "modelyard_queue_depth", model="a") == 0


def check_a_killed_engine_reads_down(server: Server, engine_pid: int) -> None:
    os.kill(engine_pid, signal.SIGKILL)
    s = poll(lambda: (found := scrape(server))
             and value(found, "modelyard_engine_up", engine="engine-0") == 0 and found,
             what="engine_up 0")
    assert not matching(s, "modelyard_device_memory_total_bytes", engine="engine-0")
    # What the dead process counted is still summed.
    assert value(s, "modelyard_model_loads_total", model="a", engine="engine-0",
                 outcome="success") == 1


def test_metrics_need_no_admin_token_on_loopback(tmp_path: Path) -> None:
    """/metrics is in the inference route class: open on loopback with auth auto, a token
    with the inference scope elsewhere (docs/security.md)."""
    server = Server(tmp_path / "front", config(), "--single-process")
    try:
        server.wait_healthy()
        r = httpx.get(server.url + "/metrics", timeout=10)
        assert r.status_code == 200, r.text
        assert "modelyard_engine_up" in r.text
    finally:
        server.stop()


def test_a_pull_counts_its_bytes_and_its_job(tmp_path: Path) -> None:
    size = 1_000_000
    root = tmp_path / "hub" / "repos"
    quant_repo(root, "org/metrics-GGUF", size, ("Q4_0",), seed=3)
    with HubServer(root, log=tmp_path / "hub.jsonl") as hub, running_server(
        tmp_path / "home", config(), hub_env(hub, tmp_path / "hf")
    ) as server:
        job = wait_job(server, submit(server, "org/metrics-GGUF:Q4_0")["job_id"])
        assert job["status"] == "succeeded", job
        s = scrape(server)
        assert value(s, "modelyard_pull_bytes_total") == size
        assert value(s, "modelyard_pull_jobs_total", status="succeeded") == 1
        assert value(s, "modelyard_pull_jobs_active", status="running") == 0


def test_a_fresh_server_exposes_every_metric_family(start_server: Any) -> None:
    """Before anything was loaded, evicted, pulled or requested, every family metrics.py
    defines is described (an unlabelled one at 0), so a rate over it reads 0, not "no data"."""
    server = start_server(config())
    r = httpx.get(server.url + "/metrics", headers=server.admin_headers, timeout=10)
    assert r.status_code == 200, r.text
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    missing = [spec.name for spec in metrics.SPECS if family_name(spec) not in families]
    assert missing == []
    for spec in metrics.SPECS:
        family = families[family_name(spec)]
        assert family.type == spec.kind, spec.name
        if not spec.labels and spec.recorded:
            assert [s.value for s in family.samples if s.name == spec.name] == [0.0]
    assert "modelyard_model_evictions" in families  # the one the probe found missing
