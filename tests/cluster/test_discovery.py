"""Discovery, routing across nodes, and who may talk to a node's engines (issue 20).

One cluster (n2, n3: one simulated 24 GiB GPU each) and one front for the module. Models claim
13 GiB: two never share a node, so the second goes to the other node, and a third must evict;
the scheduler evicts the least recently used one, on the node that held it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from tests.cluster.harness import (
    NODES,
    RayTestCluster,
    chat,
    engines,
    model_on,
    ready_on,
    sim_model,
    wait_engines,
)
from tests.support import Server

from modelyard.wire.cluster import NAMESPACE, agent_name
from modelyard.wire.lease import Hello

ray = pytest.importorskip("ray", reason="the cluster tier needs the `cluster` extra")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

ENGINES = {"n2/engine-0", "n3/engine-0"}


@pytest.fixture(scope="module")
def front(ray_cluster: RayTestCluster) -> Iterator[Server]:
    server = ray_cluster.front(sim_model("a", 13), sim_model("b", 13), sim_model("c", 13))
    wait_engines(server, ENGINES)
    yield server


def test_one_agent_per_node_and_engines_on_node_addresses(
    ray_cluster: RayTestCluster, front: Server
) -> None:
    named = {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}
    assert named == {(NAMESPACE, agent_name(h)) for h in NODES}  # none on the head, one a node
    for host, address in NODES.items():
        report = ray_cluster.report(host)
        assert (report.host, report.address, report.gpus) == (host, address, 1)
        assert [urlsplit(e.base_url).hostname for e in report.engines] == [address]
        assert all(e.up for e in report.engines)
    assert set(engines(front)) == ENGINES


def test_models_go_where_they_fit_and_the_lru_one_is_evicted_on_its_node(front: Server) -> None:
    for model in ("a", "b"):
        r = chat(front, model)
        assert r.status_code == 200, r.text
    placed = ready_on(front)
    assert {placed["a"], placed["b"]} == ENGINES  # 13 + 13 GiB do not fit one 24 GiB node
    assert chat(front, "b").status_code == 200  # a is now the least recently used
    r = chat(front, "c")
    assert r.status_code == 200, r.text
    after = ready_on(front)
    assert "a" not in after
    assert after == {"b": placed["b"], "c": placed["a"]}  # c took a's place, on a's node


def test_an_engine_api_without_the_cluster_secret_is_refused(
    ray_cluster: RayTestCluster, front: Server
) -> None:
    for host in NODES:
        base_url = ray_cluster.report(host).engines[0].base_url
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(base_url + "/status", headers=headers, timeout=10)
            assert (r.status_code, r.json()["error"]) == (401, "unauthorized"), r.text
        # the derived secret is the key: with it, the same call answers
        ok = httpx.get(base_url + "/status", timeout=10,
                       headers={"Authorization": f"Bearer {ray_cluster.secret}"})
        assert ok.status_code == 200, ok.text


def _hello(address: str, port: int, secret: str) -> bytes:
    """What the lease channel answers a hello with `secret` before it closes (b"" = nothing)."""
    with socket.create_connection((address, port), timeout=10) as sock:
        sock.sendall(Hello(secret).encode())
        answer = b""
        while b"\n" not in answer and (chunk := sock.recv(4096)):
            answer += chunk
        return answer


def test_the_lease_channel_without_the_cluster_secret_is_closed(
    ray_cluster: RayTestCluster, front: Server
) -> None:
    for host, address in NODES.items():
        port = ray_cluster.report(host).engines[0].lease_port
        assert _hello(address, port, "wrong" * 8) == b""  # closed without an answer
        assert b'"op":"hello"' in _hello(address, port, ray_cluster.secret).replace(b" ", b"")


def test_model_servers_listen_on_their_node_address(front: Server) -> None:
    assert chat(front, "b").status_code == 200
    host = ready_on(front)["b"].split("/")[0]
    upstream = model_on(front, "b")["upstream"]
    assert urlsplit(upstream).hostname == NODES[host], upstream


def test_a_backend_without_the_lease_api_key_is_refused(front: Server) -> None:
    assert chat(front, "b").status_code == 200
    upstream = model_on(front, "b")["upstream"]
    r = httpx.post(upstream.rstrip("/") + "/v1/chat/completions", timeout=10,
                   json={"model": "b", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401, r.text



def _drain(front: Server, host: str, on: bool) -> httpx.Response:
    return httpx.post(front.url + "/admin/cluster/drain", json={"host": host, "drain": on},
                      headers=front.admin_headers, timeout=30)


def test_a_draining_node_takes_no_new_load_and_serves_what_it_holds(front: Server) -> None:
    """Both nodes hold one 13 GiB model; a cold one needs an eviction on either, and routing
    breaks that tie by order: n2 — unless n2 is draining."""
    for model in ("b", "c"):
        assert chat(front, model).status_code == 200
    held = ready_on(front)
    assert set(held.values()) == ENGINES and "a" not in held, held
    on_n2 = next(m for m, e in held.items() if e == "n2/engine-0")
    r = _drain(front, "n2", True)
    assert r.status_code == 200 and r.json()["draining"] is True, r.text
    try:
        listed = httpx.get(front.url + "/admin/cluster", headers=front.admin_headers, timeout=30)
        assert {n["host"]: n["draining"] for n in listed.json()["nodes"]} == {
            "n2": True, "n3": False}
        assert chat(front, "a").status_code == 200
        after = ready_on(front)
        assert after["a"] == "n3/engine-0", after  # not on the draining node
        assert after[on_n2] == "n2/engine-0"  # what n2 holds stays, and still serves
        assert chat(front, on_n2).status_code == 200
        assert ready_on(front)[on_n2] == "n2/engine-0"
    finally:
        assert _drain(front, "n2", False).status_code == 200
    assert _drain(front, "nowhere", True).json()["error"] == "node_not_found"
