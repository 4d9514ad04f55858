"""The cluster's shared vocabulary: what a node's `NodeAgent` (cluster/node_agent.py, a Ray actor)
reports to the front's `RayProvider` (front/engines/ray_provider.py), and the names both use.

Ray supplies membership, placement and death signals; the data path stays plain HTTP from the
front to each engine and backend at its node's address (DESIGN.md §1). Every engine of a cluster
is called with one secret derived from the cluster's token file (`modelyard join --token-file`):
the same file Ray's own token authentication reads (`RAY_AUTH_TOKEN_PATH`), so one file is the
whole trust boundary, and the derived secret (HMAC, never the token itself) is what crosses to
engine processes.

Reports are plain JSON (Ray pickles whatever it is given; a dict of builtins is the same on every
Python and needs no class of ours on the other side).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NAMESPACE = "modelyard"  # the Ray namespace of every actor modelyard creates
NODE_LABEL = "modelyard.io/node"  # a node joined for modelyard carries NODE_LABEL=true
HOST_LABEL = "modelyard.io/host"  # its host name (actors are named by it: node ids change)
TOKEN_FILE_ENV = "MODELYARD_CLUSTER_TOKEN_FILE"  # the raylet's env: where the node's token is
STORAGE_ID_FILE = ".modelyard-storage-id"  # in models_dir: the same id on every node = shared
CLUSTER_PROTOCOL = 1  # the agent ↔ provider report format


def agent_name(host: str) -> str:
    """The detached NodeAgent actor of `host`, in NAMESPACE."""
    return f"node:{host}"


def engine_name(host: str, index: int) -> str:
    """How the front names engine `index` of node `host` (routing, ps, the Studio)."""
    return f"{host}/engine-{index}"


def read_token(path: Path) -> str:
    """The cluster token in `path` (stripped); ValueError when it is missing, empty, or readable
    by others (the file is a password: 0600, the owner's)."""
    try:
        mode = path.stat().st_mode
        token = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the cluster token file {path}: {exc}") from exc
    if mode & 0o077:
        raise ValueError(f"the cluster token file {path} is readable by others: chmod 600 it")
    if len(token) < 32:
        raise ValueError(f"the cluster token in {path} is too short (32 characters at least)")
    return token


def engine_secret(token: str) -> str:
    """The secret every engine of the cluster is called with: derived from the token, so a
    process that learns an engine's secret learns nothing about Ray's token."""
    return hmac.new(token.encode(), b"modelyard engine channel v1", hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class EngineEndpoint:
    """One engine process of a node, as its agent runs it."""

    index: int
    base_url: str  # http://<node address>:<port>
    lease_port: int  # its lease channel, at the same address
    up: bool  # answering its health probe (a wedged or restarting engine is not)
    restarts: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "base_url": self.base_url, "lease_port": self.lease_port,
                "up": self.up, "restarts": self.restarts}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EngineEndpoint:
        return cls(int(d["index"]), str(d["base_url"]), int(d["lease_port"]), bool(d["up"]),
                   int(d.get("restarts", 0)))


@dataclass(frozen=True)
class NodeReport:
    """What a node's agent says about itself; `version` grows with every change, so the front
    long-polls `changed(version)` instead of asking again and again."""

    host: str
    address: str  # the node's address: engines and backends bind it
    node_id: str  # Ray's id of the node now (changes when the node rejoins)
    version: int
    gpus: int
    engines: tuple[EngineEndpoint, ...] = ()
    storage_id: str | None = None  # models_dir's STORAGE_ID_FILE, if there is one
    draining: bool = False  # `modelyard cluster drain`: no new loads here
    error: str | None = None  # why the node's engines could not start, if they could not
    configured: bool = False  # False until a front configured it (again, after Ray restarted it)
    protocol: int = CLUSTER_PROTOCOL
    labels: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host, "address": self.address, "node_id": self.node_id,
            "version": self.version, "gpus": self.gpus,
            "engines": [e.to_json() for e in self.engines], "storage_id": self.storage_id,
            "draining": self.draining, "error": self.error, "configured": self.configured,
            "protocol": self.protocol,
            "labels": dict(self.labels),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> NodeReport:
        return cls(
            host=str(d["host"]), address=str(d["address"]), node_id=str(d["node_id"]),
            version=int(d["version"]), gpus=int(d["gpus"]),
            engines=tuple(EngineEndpoint.from_json(e) for e in d.get("engines", ())),
            storage_id=d.get("storage_id"), draining=bool(d.get("draining", False)),
            error=d.get("error"), configured=bool(d.get("configured", False)),
            protocol=int(d.get("protocol", CLUSTER_PROTOCOL)),
            labels={str(k): str(v) for k, v in (d.get("labels") or {}).items()},
        )
