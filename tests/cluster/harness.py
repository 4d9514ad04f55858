"""The `cluster` tier: a real Ray cluster of simulated nodes on loopback addresses.

Topology (one cluster per test module, started in ~8 s): the head at 127.0.0.4 (where the front
runs: its `node_address`), nodes n2 at 127.0.0.2 and n3 at 127.0.0.3, each labelled
`modelyard.io/node=true` with its host name, one CPU, a small object store, and an environment
its NodeAgent inherits: its own MODELYARD_HOME, one simulated 24 GiB GPU, the cluster token file.
Not 127.0.0.1: Ray rewrites that to the machine's external address, and an engine bound to the
node's own address is what the tier checks.

Ray's token authentication is on (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH=<the 0600 token>) for
the Cluster, this test process (a Ray driver too, to look at agents) and the fronts it starts;
the environment is restored at teardown. Everything started is stopped at teardown: fronts,
the driver, the cluster (its raylets take the agents and, through them, engines and backends).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from pathlib import Path
from typing import Any

import httpx
from tests.support import Server, fake_model, poll

from modelyard.wire.cluster import (
    HOST_LABEL,
    NAMESPACE,
    NODE_LABEL,
    TOKEN_FILE_ENV,
    NodeReport,
    agent_name,
    engine_secret,
)

GIB = 2**30
HEAD = "127.0.0.4"
NODES = {"n2": "127.0.0.2", "n3": "127.0.0.3"}
NODE_GPU_GIB = 24
OBJECT_STORE = 80 * 2**20
HELLO = [{"role": "user", "content": "Say hello to me"}]


def sim_model(model_id: str, gib: float, *flags: str, **fields: Any) -> dict[str, Any]:
    """A fake model that really claims `gib` of its node's simulated GPU while it runs."""
    nbytes = int(gib * GIB)
    return fake_model(model_id, "--claim-bytes", str(nbytes), *flags, vram_bytes=nbytes,
                      **fields)


class RayTestCluster:
    """The head and two labelled nodes; nodes can leave (`remove`) and rejoin (`add`)."""

    def __init__(self, base: Path) -> None:
        import ray
        from ray.cluster_utils import Cluster

        self.base = base
        self.token_file = base / "cluster-token"
        self.token_file.write_text(secrets.token_hex(32))
        self.token_file.chmod(0o600)
        self.secret = engine_secret(self.token_file.read_text().strip())
        self.nodes: dict[str, Any] = {}
        self.fronts: list[Server] = []
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False, "node_ip_address": HEAD,
            "object_store_memory": OBJECT_STORE,
        })
        for host in NODES:
            self.add(host, wait=False)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, namespace=NAMESPACE, _node_ip_address=HEAD,
                 log_to_driver=False, configure_logging=False)

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def home(self, host: str) -> Path:
        return self.base / host

    def add(self, host: str, wait: bool = True) -> None:
        """Start (or restart) node `host` with its labels and environment."""
        self.nodes[host] = self.cluster.add_node(
            num_cpus=1, node_ip_address=NODES[host], object_store_memory=OBJECT_STORE,
            labels={NODE_LABEL: "true", HOST_LABEL: host},
            env_vars={"MODELYARD_HOME": str(self.home(host)),
                      "MODELYARD_SIMULATE_GPUS": f"1x{NODE_GPU_GIB}GiB",
                      TOKEN_FILE_ENV: str(self.token_file),
                      "MODELYARD_EMBEDDING_DEMO": "false"},
        )
        if wait:
            self.cluster.wait_for_nodes()

    def remove(self, host: str) -> None:
        """Node `host` leaves at once (its raylet and every process under it killed)."""
        self.cluster.remove_node(self.nodes.pop(host), allow_graceful=False)

    def agent(self, host: str) -> Any:
        import ray

        return ray.get_actor(agent_name(host), namespace=NAMESPACE)

    def report(self, host: str) -> NodeReport:
        import ray

        return NodeReport.from_json(ray.get(self.agent(host).report.remote(), timeout=30))

    def front(self, *models: dict[str, Any], name: str = "front", **settings: Any) -> Server:
        """`modelyard serve` as this cluster's front (a Ray driver at the head's address)."""
        # As a user starts it: with only its config's token_file, none of Ray's RAY_AUTH_*
        # variables (the provider sets them before Ray is imported: a front that did not was
        # refused by a head with token auth).
        saved = {k: os.environ.pop(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")
                 if k in os.environ}
        try:
            server = Server(self.base / name, self.front_config(*models, **settings))
        finally:
            os.environ.update(saved)
        self.fronts.append(server)
        try:
            server.wait_healthy(120)
        except Exception:
            server.stop()
            raise
        return server

    def front_config(self, *models: dict[str, Any], **settings: Any) -> dict[str, Any]:
        return {"scan_hf_cache": False, "node_address": HEAD, **settings,
                "cluster": {"mode": "ray", "ray_address": self.address,
                            "token_file": str(self.token_file)},
                "models": list(models)}

    def shutdown(self) -> None:
        import ray

        for server in self.fronts:
            with contextlib.suppress(Exception):
                server.stop()
        with contextlib.suppress(Exception):
            ray.shutdown()
        self.cluster.shutdown()


# ---- helpers the tests share ------------------------------------------------------------------


def chat(server: Server, model: str, **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions",
                      json={"model": model, "messages": HELLO, "max_tokens": 3, **body},
                      timeout=60)


def status(server: Server) -> dict[str, Any]:
    """The admin's /status: engines with their pids, models with their upstream URLs."""
    r = httpx.get(server.url + "/status", headers=server.admin_headers, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def engines(server: Server) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in status(server)["engines"]}


def ready_on(server: Server) -> dict[str, str]:
    """model → the engine that holds it ready."""
    return {m["model"]: name for name, e in engines(server).items()
            for m in e.get("models", []) if m["state"] == "ready"}


def model_on(server: Server, model: str) -> dict[str, Any]:
    for e in engines(server).values():
        for m in e.get("models", []):
            if m["model"] == model and m["state"] == "ready":
                return dict(m)
    raise AssertionError(f"{model} is not ready on any engine: {engines(server)}")


def wait_engines(server: Server, names: set[str], timeout_s: float = 60.0) -> None:
    """Until the front lists exactly the engines `names`, all up."""
    def check() -> bool:
        found = engines(server)
        return set(found) == names and all(e["up"] for e in found.values())
    poll(check, timeout_s, f"engines {sorted(names)} up")


def in_flight(server: Server) -> int:
    """Leases held on every engine the front lists (the engines' own count)."""
    return sum(int(m.get("leases") or 0) for e in engines(server).values()
               for m in e.get("models", []))


def elapsed(since: float) -> float:
    return time.monotonic() - since
