"""Chaos on a cluster (issue 20): a front restart, a wedged engine, a node that leaves mid-stream
and comes back.

One cluster and one front lineage for the module; the tests run in file order and each leaves
the cluster whole for the next (the last one brings the removed node back).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tests.cluster.harness import (
    HELLO,
    NODES,
    RayTestCluster,
    chat,
    elapsed,
    engines,
    in_flight,
    model_on,
    ready_on,
    sim_model,
    wait_engines,
)
from tests.support import Server, poll

ray = pytest.importorskip("ray", reason="the cluster tier needs the `cluster` extra")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

ENGINES = {"n2/engine-0", "n3/engine-0"}
MODELS = (
    sim_model("slow", 2, "--tokens-per-s", "5"),
    sim_model("any", 2),
    *(sim_model(f"p{h[1:]}", 1, engine=f"{h}/engine-0") for h in NODES),  # p2 on n2, p3 on n3
)


class Fronts:
    """The module's front; `restart` replaces it by a new process (a new Ray driver)."""

    def __init__(self, cluster: RayTestCluster) -> None:
        self.cluster = cluster
        self.now = self._start("front-0")

    def _start(self, name: str) -> Server:
        server = self.cluster.front(*MODELS, name=name,
                                    engine_heartbeat_timeout_s=2.0, engine_health_timeout_s=2.0)
        wait_engines(server, ENGINES)
        return server

    def restart(self) -> Server:
        self.now.stop()
        self.now = self._start(f"front-{len(self.cluster.fronts)}")
        return self.now


@pytest.fixture(scope="module")
def fronts(ray_cluster: RayTestCluster) -> Iterator[Fronts]:
    yield Fronts(ray_cluster)


def test_a_restarted_front_finds_the_models_still_loaded(fronts: Fronts) -> None:
    for model in ("p2", "p3"):
        assert chat(fronts.now, model).status_code == 200
    before = {m: model_on(fronts.now, m)["pid"] for m in ("p2", "p3")}
    assert all(before.values())
    front = fronts.restart()
    # the agents are detached: their engines, and the model servers under them, kept running
    assert {m: model_on(front, m)["pid"] for m in ("p2", "p3")} == before
    for model in ("p2", "p3"):
        r = chat(front, model)
        assert r.status_code == 200, r.text
    assert {m: model_on(front, m)["pid"] for m in ("p2", "p3")} == before  # no reload
    assert ready_on(front)["p2"] == "n2/engine-0" and ready_on(front)["p3"] == "n3/engine-0"


def test_a_stopped_engine_is_down_fast_and_requests_go_to_the_other_node(fronts: Fronts) -> None:
    front = fronts.now
    assert chat(front, "any").status_code == 200
    wedged = ready_on(front)["any"]
    other = (ENGINES - {wedged}).pop()
    pid = int(engines(front)[wedged]["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        r = chat(front, "any")
        took = elapsed(started)
        assert r.status_code == 200, r.text
        assert ready_on(front)["any"] == other  # loaded on the live node instead
        # the heartbeat (2 s) found it silent; nothing waited for a request timeout
        assert took < 15, took
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    wait_engines(front, ENGINES)  # it answers again (or its agent restarted it)


def _stream(server: Server, model: str, lines: list[tuple[float, str]],
            started: threading.Event, ended: threading.Event) -> None:
    body = {"model": model, "messages": HELLO, "stream": True, "max_tokens": 200}
    try:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    lines.append((time.monotonic(), line[5:].strip()))
                    if len(lines) >= 3:
                        started.set()
    finally:
        started.set()
        ended.set()


def _events(lines: list[tuple[float, str]]) -> list[Any]:
    return [json.loads(data) for _, data in lines if data != "[DONE]"]


def test_a_node_that_leaves_mid_stream_ends_it_in_band(
    ray_cluster: RayTestCluster, fronts: Fronts
) -> None:
    front = fronts.now
    assert chat(front, "slow").status_code == 200
    gone = ready_on(front)["slow"]
    host = gone.split("/")[0]
    lines: list[tuple[float, str]] = []
    started, ended = threading.Event(), threading.Event()
    reader = threading.Thread(target=_stream, args=(front, "slow", lines, started, ended))
    reader.start()
    try:
        assert started.wait(30) and len(lines) >= 3, lines
        removed = time.monotonic()
        ray_cluster.remove(host)
        assert ended.wait(30), "the stream did not end after its node left"
    finally:
        reader.join(60)
    errors = [e["error"] for e in _events(lines) if "error" in e]
    assert errors, lines[-3:]  # in-band: the client knows the answer is cut, not complete
    # Removing a node kills its processes: the backend's connection resets a moment before its
    # engine's lease channel closes, and the front waits that moment to say which died
    # (front/dispatch/relay.py `stream_broke`). A machine that vanishes resets nothing: the
    # heartbeat finds it, with the same code.
    assert errors[-1]["code"] == "engine_unavailable", errors
    assert lines[-1][0] - removed < 10  # within seconds, not at a request timeout
    # the survivor serves the next request (the model loads there)
    r = chat(front, "slow")
    assert r.status_code == 200, r.text
    survivor = (ENGINES - {gone}).pop()
    assert ready_on(front)["slow"] == survivor
    # the node's engine leaves the front's list once Ray reports the node dead
    poll(lambda: set(engines(front)) == {survivor}, 30, f"{gone} removed")
    poll(lambda: in_flight(front) == 0, 20, "no lease left held")


def test_a_node_that_rejoins_gets_its_agent_back_and_serves(
    ray_cluster: RayTestCluster, fronts: Fronts
) -> None:
    front = fronts.now
    (host,) = set(NODES) - set(ray_cluster.nodes)  # the node the previous test removed
    ray_cluster.add(host)
    wait_engines(front, ENGINES, 90)
    report = ray_cluster.report(host)
    assert report.address == NODES[host] and all(e.up for e in report.engines)
    model = f"p{host[1:]}"  # pinned to that node's engine
    r = chat(front, model)
    assert r.status_code == 200, r.text
    assert ready_on(front)[model] == f"{host}/engine-0"
