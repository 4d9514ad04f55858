"""`NodeAgent`: the Ray actor that runs one node's engines (DESIGN.md §1, docs/cluster.md).

One per node, detached, named `agent_name(host)` in the `modelyard` namespace, pinned to its node
(hard affinity), `num_cpus=0`, restarted by Ray when it dies: the front's `RayProvider`
(front/engines/ray_provider.py) creates it with `get_if_exists`, so a restarted front finds the
same agent, with its engines and their models still loaded.

It runs the same engine supervisor as `modelyard serve` on one machine
(front/engines/supervisor.py): one `modelyard serve --engine-only` process per device group, bound
to the node's address, called with the cluster's engine secret (wire/cluster.py
`engine_secret`), restarted when it crashes, killed when its health probe finds it wedged (which
Ray cannot see). Engines watch their parent: when this actor's process dies, they and their model
servers die with it; Ray restarts the actor, and the front configures it again.

Nothing flows through Ray but this: the front's configuration in (`configure`), the node's
report out (`report`, `changed`: a long poll, so a change reaches the front at once and nothing
polls). Requests go front → engine → model server over plain HTTP at the node's address.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from modelyard import home as home_dir
from modelyard.config import Settings, load_settings
from modelyard.errors import ModelyardError
from modelyard.front.engines.supervisor import EngineSupervisor, plan_engines
from modelyard.hw.simulated import parse_simulated_gpus
from modelyard.hw.smi import query_gpus
from modelyard.wire.cluster import (
    STORAGE_ID_FILE,
    TOKEN_FILE_ENV,
    EngineEndpoint,
    NodeReport,
    engine_secret,
    read_token,
)

log = logging.getLogger("modelyard.cluster.agent")

# Front settings a node keeps its own of: where its data lives, the address it binds, its devices.
NODE_OWN = ("home", "node_address", "simulate_gpus")


class _EngineRecord:
    """What the agent knows of one engine it supervises (the supervisor's `SupervisedClient`)."""

    def __init__(self, name: str, index: int, changed: Any) -> None:
        self.name = name
        self.index = index
        self.base_url = ""
        self.lease_port = 0
        self.up = False
        self.error: str | None = None
        self._changed = changed

    async def attach(self, base_url: str, lease_port: int, secret: str, *,
                     report_timeout_s: float | None = None,
                     heartbeat_timeout_s: float = 0.0) -> None:
        self.base_url, self.lease_port, self.up, self.error = base_url, lease_port, True, None
        self._changed()

    async def detach(self) -> None:
        if self.up:
            self.up = False
            self._changed()

    def refuse(self, why: ModelyardError) -> None:
        self.error = why.message
        self._changed()

    def set_answering(self, answering: bool) -> None:
        if self.base_url and answering != self.up:
            self.up = answering
            self._changed()


class NodeAgent:
    """The actor's class (made a Ray actor by the provider: `ray.remote(NodeAgent)`)."""

    def __init__(self, host: str) -> None:
        import ray

        self.host = host
        self.address = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self.node_id = ray.get_runtime_context().get_node_id()
        self.home = Path(os.environ.get("MODELYARD_HOME", Path.home() / ".modelyard")).expanduser()
        self.simulate_gpus = os.environ.get("MODELYARD_SIMULATE_GPUS") or None
        token_file = os.environ.get(TOKEN_FILE_ENV)
        self._secret: str | None = None
        self._error: str | None = None
        if token_file:
            try:
                self._secret = engine_secret(read_token(Path(token_file).expanduser()))
            except ValueError as exc:
                self._error = str(exc)
        else:
            self._error = (f"this node has no cluster token (${TOKEN_FILE_ENV} is not set in its "
                           "Ray node's environment: join it with `modelyard join`)")
        self._version = 1
        self._changed: asyncio.Event | None = None  # made on the actor's loop, when first used
        self._supervisors: list[EngineSupervisor] = []
        self._records: list[_EngineRecord] = []
        self._config: dict[str, Any] | None = None
        self._draining = False
        self._configuring = False
        self.gpus = 0

    # ---- what the front calls -----------------------------------------------------------------

    async def ping(self) -> str:
        return self.host

    async def report(self) -> dict[str, Any]:
        return self._report().to_json()

    async def changed(self, version: int, timeout_s: float) -> dict[str, Any]:
        """The report, once its version is past `version` (or at `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while self._version <= version:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event().wait(), left)
        return self._report().to_json()

    async def configure(self, settings: dict[str, Any]) -> dict[str, Any]:
        """Run this node's engines with the front's `settings` (a Settings as JSON). The same
        settings again change nothing (a restarted front re-attaches to running engines); other
        settings go to the running engines as a reload."""
        own = self._own(settings)
        if self._error is not None and self._secret is None:
            return self._report().to_json()
        if self._config == own and self._supervisors:
            return self._report().to_json()
        if self._supervisors:
            await self._reload(own)
        else:
            await self._start(own)
        return self._report().to_json()

    async def drain(self, on: bool) -> dict[str, Any]:
        """Draining: the front sends no new loads here (models loaded keep serving)."""
        if self._draining != on:
            self._draining = on
            self._bump()
        return self._report().to_json()

    async def shutdown(self) -> None:
        """Stop this node's engines (and their model servers)."""
        supervisors, self._supervisors = self._supervisors, []
        self._records = []
        self._config = None
        for supervisor in reversed(supervisors):
            await supervisor.stop()
        self._bump()

    # ---- inside -------------------------------------------------------------------------------

    def _own(self, settings: dict[str, Any]) -> dict[str, Any]:
        own = {k: v for k, v in settings.items() if k not in NODE_OWN}
        own["home"] = str(self.home)
        own["node_address"] = self.address
        own["simulate_gpus"] = self.simulate_gpus
        return own

    def _settings(self, own: dict[str, Any]) -> tuple[Settings, Path]:
        """The node's settings, and the private file its engines read them from."""
        home_dir.private_umask()
        home_dir.secure(self.home, skip=(self.home / "models",))
        config_file = self.home / "cluster" / "engine-config.json"
        config_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        config_file.write_text(json.dumps(own))  # the umask keeps it 0600 from its first byte
        return load_settings(config_file), config_file

    async def _start(self, own: dict[str, Any]) -> None:
        if self._configuring:
            return
        self._configuring = True
        try:
            settings, config_file = await asyncio.to_thread(self._settings, own)
            self.gpus = (len(parse_simulated_gpus(settings.simulate_gpus))
                         if settings.simulate_gpus else
                         0 if settings.devices == "cpu" else len(await asyncio.to_thread(
                             query_gpus)))
            self._config = own
            self._error = None
            for plan in plan_engines(settings, self.gpus):
                record = _EngineRecord(f"engine-{plan.index}", plan.index, self._bump)
                supervisor = EngineSupervisor(settings, plan, record, config_file=config_file,
                                              on_change=self._bump, secret=self._secret)
                try:
                    await supervisor.start()
                except RuntimeError as exc:
                    log.error("%s: %s", self.host, exc)
                    self._error = str(exc)
                    await supervisor.stop()
                    continue
                self._supervisors.append(supervisor)
                self._records.append(record)
        except (OSError, ValueError) as exc:
            self._error = f"cannot start this node's engines: {exc}"
            log.error("%s: %s", self.host, self._error)
        finally:
            self._configuring = False
            self._bump()

    async def _reload(self, own: dict[str, Any]) -> None:
        """New settings for running engines: written for their next start, and sent to each."""
        import httpx

        settings, _ = await asyncio.to_thread(self._settings, own)
        self._config = own
        body = settings.model_dump(mode="json")
        async with httpx.AsyncClient(timeout=30.0) as http:
            for record in self._records:
                if not record.up:
                    continue
                try:
                    await http.post(f"{record.base_url}/reload", json=body,
                                    headers={"Authorization": f"Bearer {self._secret}"})
                except httpx.HTTPError as exc:
                    log.warning("%s: reload of %s failed: %s", self.host, record.name, exc)
        self._bump()

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _bump(self) -> None:
        self._version += 1
        changed, self._changed = self._event(), asyncio.Event()
        changed.set()

    def _storage_id(self) -> str | None:
        try:
            return (self.home / "models" / STORAGE_ID_FILE).read_text().strip() or None
        except OSError:
            return None

    def _report(self) -> NodeReport:
        restarts = {s.plan.index: s.restarts for s in self._supervisors}
        return NodeReport(
            host=self.host,
            address=self.address,
            node_id=self.node_id,
            version=self._version,
            gpus=self.gpus,
            engines=tuple(
                EngineEndpoint(r.index, r.base_url, r.lease_port, r.up, restarts.get(r.index, 0))
                for r in self._records if r.base_url
            ),
            storage_id=self._storage_id(),
            draining=self._draining,
            error=self._error,
            configured=self._config is not None,
            labels={"hostname": socket.gethostname()},
        )
