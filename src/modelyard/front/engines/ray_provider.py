"""`RayProvider`: the engines of every node of a Ray cluster, for one front (`cluster.mode: ray`).

The front is a Ray driver. It finds the alive nodes labelled `modelyard.io/node=true`, makes sure
each has its `NodeAgent` (cluster/node_agent.py: detached, named by host, pinned to the node;
`get_if_exists`, so a restarted front finds the agents and their engines still running),
configures it with the front's settings, and follows its report by long poll. Each engine a
report lists becomes an `HttpEngineClient` named `<host>/engine-<i>`, attached at the node's
address with the cluster's engine secret: from there on the front talks to it exactly as to a
local engine process (leases with heartbeats, plain HTTP), and Ray is not on the request path.

Death signals, and what they do:
- an engine's lease channel falls silent (heartbeat) or closes: its client is down at once (its
  relays end in-band with engine_unavailable: front/engines/client.py);
- the agent is unavailable (its process died and Ray restarts it; the node is unreachable): the
  node's engines are down until a report says otherwise;
- the agent died or cannot be scheduled any more (its node left the cluster), or the node is no
  longer alive: the node's engines are removed from the set.
A node that joins (or rejoins, with a new node id) is found by the next look at the node list.

Ray is imported lazily: a front that is not a cluster front never loads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelyard.config import Settings
from modelyard.errors import EngineProtocolMismatch, NodeNotFound
from modelyard.front.engines.catalog_feed import CatalogFeed
from modelyard.front.engines.client import HttpEngineClient
from modelyard.front.engines.provider import _Published
from modelyard.wire.cluster import (
    HOST_LABEL,
    NAMESPACE,
    NODE_LABEL,
    EngineEndpoint,
    NodeReport,
    agent_name,
    engine_name,
    engine_secret,
    read_token,
)

log = logging.getLogger("modelyard.cluster")

LONG_POLL_S = 10.0  # an agent's `changed` returns at least this often (a chance to notice a stop)
UNAVAILABLE_RETRY_S = 0.5


def default_token_file(settings: Settings) -> Path:
    return settings.cluster.token_file or settings.home / "cluster-token"


@dataclass
class _Node:
    host: str
    node_id: str
    agent: Any  # a Ray ActorHandle
    report: NodeReport | None = None
    clients: dict[int, HttpEngineClient] = field(default_factory=dict)
    attached: dict[int, tuple[str, int]] = field(default_factory=dict)  # index → (url, lease)
    task: asyncio.Task[None] | None = None
    first_report: asyncio.Event = field(default_factory=asyncio.Event)


class RayProvider(_Published):
    """Engines on every node of the Ray cluster (see the module's docstring)."""

    def __init__(self, settings: Settings, *, catalog: CatalogFeed | None = None) -> None:
        super().__init__(0)
        self.settings = settings
        self.catalog = catalog  # pushed to each engine when it attaches (nodes have no database)
        self.token_file = default_token_file(settings)
        self._secret = ""
        self._nodes: dict[str, _Node] = {}
        self._indexes: dict[str, int] = {}  # engine name → its index, kept while the front runs
        self._poller: asyncio.Task[None] | None = None
        self._stopping = False

    # ---- EngineProvider -------------------------------------------------------------------------

    @property
    def gpu_count(self) -> int:
        return sum(n.report.gpus for n in self._nodes.values() if n.report is not None)

    async def start(self) -> None:
        self._secret = engine_secret(read_token(self.token_file))
        await asyncio.to_thread(self._connect)
        await self._look()
        started = [n.first_report.wait() for n in self._nodes.values()]
        if started:
            done, _ = await asyncio.wait(
                [asyncio.ensure_future(s) for s in started],
                timeout=self.settings.cluster.agent_start_timeout_s,
            )
            if len(done) < len(started):
                log.error("some nodes' agents did not report within %.0f s; they join when they do",
                          self.settings.cluster.agent_start_timeout_s)
        else:
            log.warning("no Ray node is labelled %s=true yet: `modelyard join` one", NODE_LABEL)
        self._poller = asyncio.create_task(self._poll_nodes(), name="ray-provider:nodes")

    async def stop(self) -> None:
        """Detach from every engine; the agents and their engines keep running (a restarted
        front re-attaches to them with their models still loaded)."""
        self._stopping = True
        tasks = [t for t in (self._poller, *(n.task for n in self._nodes.values())) if t]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for node in self._nodes.values():
            for client in node.clients.values():
                await client.detach()
        self._nodes.clear()
        self._publish([])
        await asyncio.to_thread(self._disconnect)

    # ---- the cluster's view, for `modelyard cluster` and the admin API -------------------------

    def nodes(self) -> list[NodeReport]:
        return [n.report for n in sorted(self._nodes.values(), key=lambda n: n.host)
                if n.report is not None]

    async def drain(self, host: str, on: bool = True) -> NodeReport:
        node = self._nodes.get(host)
        if node is None:
            raise NodeNotFound(host)
        report = NodeReport.from_json(await node.agent.drain.remote(on))
        await self._apply(node, report)
        return report

    def draining(self, engine: str) -> bool:
        """Whether `engine` is on a draining node (no new loads go there)."""
        host = engine.rsplit("/", 1)[0]
        node = self._nodes.get(host)
        return bool(node and node.report and node.report.draining)

    # ---- Ray ------------------------------------------------------------------------------------

    def _connect(self) -> None:
        # Ray's own token authentication reads the same file (docs/cluster.md). Set before Ray
        # is first imported: it reads them once per process (a front started without them was
        # refused by a head with token auth: "RAY_AUTH_MODE is currently 'disabled'").
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        os.environ.setdefault("RAY_AUTH_TOKEN_PATH", str(self.token_file))
        import ray
        node_ip = self.settings.node_address
        ray.init(
            address=self.settings.cluster.ray_address or "auto",
            namespace=NAMESPACE,
            # This machine's address in the cluster, when it is not the default one.
            _node_ip_address=None if node_ip == "127.0.0.1" else node_ip,
            log_to_driver=False,
            logging_level=logging.WARNING,
            configure_logging=False,
        )

    def _disconnect(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.shutdown()

    def _alive_nodes(self) -> dict[str, tuple[str, dict[str, Any]]]:
        """host → (node id, Ray's node record) for every alive node labelled for modelyard."""
        import ray

        found: dict[str, tuple[str, dict[str, Any]]] = {}
        for record in ray.nodes():  # type: ignore[no-untyped-call]
            labels = record.get("Labels") or {}
            if not record.get("Alive") or labels.get(NODE_LABEL) != "true":
                continue
            host = labels.get(HOST_LABEL) or record["NodeManagerAddress"]
            found[host] = (record["NodeID"], record)
        return found

    def _agent(self, host: str, node_id: str, record: dict[str, Any]) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from modelyard.cluster.node_agent import NodeAgent

        gpus = float((record.get("Resources") or {}).get("GPU", 0))
        return ray.remote(NodeAgent).options(
            name=agent_name(host), namespace=NAMESPACE, lifetime="detached",
            get_if_exists=True, max_restarts=-1, num_cpus=0, num_gpus=gpus,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(host)

    # ---- following the nodes --------------------------------------------------------------------

    async def _look(self) -> None:
        """Nodes that joined get an agent; nodes that left lose their engines."""
        alive = await asyncio.to_thread(self._alive_nodes)
        for host in [h for h in self._nodes if h not in alive]:
            await self._drop(host, "its Ray node left the cluster")
        for host, (node_id, record) in alive.items():
            node = self._nodes.get(host)
            if node is not None and node.node_id == node_id:
                continue
            if node is not None:  # the same host rejoined as a new Ray node
                await self._drop(host, "its Ray node rejoined")
            try:
                agent = await asyncio.to_thread(self._agent, host, node_id, record)
            except Exception as exc:  # Ray's errors vary by version; log and look again later
                log.error("cannot create the agent of node %s: %s", host, exc)
                continue
            node = _Node(host, node_id, agent)
            self._nodes[host] = node
            node.task = asyncio.create_task(self._follow(node), name=f"ray-provider:{host}")

    async def _poll_nodes(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.settings.cluster.node_poll_interval_s)  # Ray sends no event
            try:
                await self._look()
            except Exception as exc:
                log.error("looking at the cluster's nodes failed: %s", exc)

    async def _follow(self, node: _Node) -> None:
        """Follow `node`'s agent until it dies (then its engines go)."""
        from ray import exceptions as rx

        version = -1
        settings_json = self.settings.model_dump(mode="json")
        while not self._stopping:
            try:
                data = await node.agent.changed.remote(version, LONG_POLL_S)
                report = NodeReport.from_json(data)
                if not report.configured and report.error is None:
                    report = NodeReport.from_json(await node.agent.configure.remote(settings_json))
            except rx.ActorUnavailableError:
                # Restarting, or not reachable now: its engines are down until it reports.
                self._set_down(node, "its node's agent is unavailable")
                await asyncio.sleep(UNAVAILABLE_RETRY_S)
                continue
            except (rx.RayActorError, rx.ActorUnschedulableError) as exc:
                await self._drop(node.host, f"its node's agent died ({type(exc).__name__})")
                return
            if report.node_id != node.node_id:
                log.warning("the agent of %s runs on node %s, not %s: replaced", node.host,
                            report.node_id[:8], node.node_id[:8])
                await self._drop(node.host, "its agent is on a node that left")
                await asyncio.to_thread(self._kill, node.agent)
                return
            version = report.version
            if report.error:
                log.error("node %s: %s", node.host, report.error)
            await self._apply(node, report)
            if report.configured or report.error:
                node.first_report.set()

    def _kill(self, agent: Any) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(agent, no_restart=True)

    async def _apply(self, node: _Node, report: NodeReport) -> None:
        """Make the node's clients match its report."""
        node.report = report
        changed = False
        seen: set[int] = set()
        for endpoint in report.engines:
            seen.add(endpoint.index)
            client = node.clients.get(endpoint.index)
            if client is None:
                name = engine_name(node.host, endpoint.index)
                index = self._indexes.setdefault(name, len(self._indexes))
                client = node.clients[endpoint.index] = HttpEngineClient(
                    name, index, catalog=self.catalog)
                changed = True
            changed |= await self._attach(node, client, endpoint)
        for index in [i for i in node.clients if i not in seen]:
            client = node.clients.pop(index)
            node.attached.pop(index, None)
            client.abort_relays("it left its node")
            await client.detach()
            changed = True
        if changed:
            self._publish_all()

    async def _attach(self, node: _Node, client: HttpEngineClient,
                      endpoint: EngineEndpoint) -> bool:
        where = (endpoint.base_url, endpoint.lease_port)
        if not endpoint.up:
            was_up = client.up
            client.set_answering(False)
            return was_up
        if node.attached.get(endpoint.index) == where and client.up:
            return False
        if endpoint.index in node.attached:
            await client.detach()  # the engine restarted at a new port
        try:
            await client.attach(
                endpoint.base_url, endpoint.lease_port, self._secret,
                report_timeout_s=self.settings.engine_health_timeout_s,
                heartbeat_timeout_s=self.settings.engine_heartbeat_timeout_s,
            )
        except EngineProtocolMismatch as exc:
            client.refuse(exc)
            return True
        except OSError as exc:
            log.warning("%s: cannot attach to %s: %s", client.name, endpoint.base_url, exc)
            node.attached.pop(endpoint.index, None)
            return True
        client.set_answering(True)
        node.attached[endpoint.index] = where
        log.info("%s attached at %s", client.name, endpoint.base_url)
        return True

    def _set_down(self, node: _Node, why: str) -> None:
        changed = False
        for client in node.clients.values():
            if client.up:
                client.set_answering(False)
                client.abort_relays(why)
                changed = True
        if changed:
            log.error("%s: %s; its engines are down", node.host, why)
            self._publish_all()

    async def _drop(self, host: str, why: str) -> None:
        node = self._nodes.pop(host, None)
        if node is None:
            return
        log.error("node %s: %s; its %d engine(s) removed", host, why, len(node.clients))
        if node.task is not None and node.task is not asyncio.current_task():
            node.task.cancel()
        for client in node.clients.values():
            client.abort_relays(why)
            await client.detach()
        node.first_report.set()
        self._publish_all()

    def _publish_all(self) -> None:
        clients: Sequence[HttpEngineClient] = [
            c for node in sorted(self._nodes.values(), key=lambda n: n.host)
            for _, c in sorted(node.clients.items())
        ]
        self._publish(clients)

