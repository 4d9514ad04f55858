"""The cluster admin API (front/api/cluster.py) on a real front served in this process: over a
single-machine provider it answers mode `off` and refuses a drain with 409 cluster_off; over a
provider that is a ClusterView (nodes(), drain(): what the RayProvider adds) it lists the nodes
and drains one, 404 node_not_found for a host that is not a node."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import yaml
from rich.console import Console
from tests.integration.harness import served_in_process
from typer.testing import CliRunner, Result

from modelyard.cli import cluster as cli_cluster
from modelyard.cli.main import app
from modelyard.config import Settings, load_settings
from modelyard.errors import NodeNotFound
from modelyard.front.app import create_app
from modelyard.front.engines.provider import _Published
from modelyard.wire.cluster import STORAGE_ID_FILE, EngineEndpoint, NodeReport
from modelyard.wire.engines import EngineProvider

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class NoEngines(_Published):
    """A single-machine provider with no engines (the API under test needs none)."""

    async def start(self) -> None:
        self._publish([])

    async def stop(self) -> None:
        pass


class FakeCluster(NoEngines):
    """What the RayProvider adds for the admin API, over canned node reports."""

    def __init__(self) -> None:
        super().__init__(2)
        self.reports = {
            "n2": NodeReport("n2", "10.0.0.2", "abcdef0123", 3, 2,
                             (EngineEndpoint(0, "http://10.0.0.2:9000", 9001, True),),
                             storage_id="store-1"),
            "n3": NodeReport("n3", "10.0.0.3", "0123abcdef", 1, 0, storage_id="other"),
        }

    def nodes(self) -> list[NodeReport]:
        return list(self.reports.values())

    async def drain(self, host: str, on: bool = True) -> NodeReport:
        if host not in self.reports:
            raise NodeNotFound(host)
        self.reports[host] = replace(self.reports[host], draining=on)
        return self.reports[host]


def prepare(home: Path) -> Settings:
    home.mkdir(parents=True, exist_ok=True)
    config_file = home / "config.yaml"
    config_file.write_text(yaml.safe_dump({"models": []}))
    settings = load_settings(config_file, home=home)
    settings.models_dir.mkdir(parents=True, exist_ok=True)
    (settings.models_dir / STORAGE_ID_FILE).write_text("store-1\n")
    return settings


@contextlib.asynccontextmanager
async def front(home: Path, provider: EngineProvider) -> AsyncIterator[httpx.AsyncClient]:
    settings = prepare(home)
    config_file = home / "config.yaml"
    app = create_app(settings, provider=provider, config_file=config_file)
    async with served_in_process(app) as port:
        token = (home / "cli-token").read_text().strip()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10,
                                     headers={"Authorization": f"Bearer {token}"}) as http:
            yield http


async def test_a_single_machine_front_is_not_a_cluster(tmp_path: Path) -> None:
    async with front(tmp_path / "home", NoEngines()) as http:
        r = await http.get("/admin/cluster")
        assert r.status_code == 200, r.text
        assert r.json() == {"mode": "off", "storage_id": None, "nodes": []}
        r = await http.post("/admin/cluster/drain", json={"host": "n2", "drain": True})
        assert r.status_code == 409, r.text
        assert r.json()["error"] == "cluster_off"
        r = await http.get("/admin/cluster", headers={"Authorization": ""})
        assert r.status_code == 401  # an admin route


async def test_a_cluster_front_lists_and_drains_its_nodes(tmp_path: Path) -> None:
    provider = FakeCluster()
    async with front(tmp_path / "home", provider) as http:
        r = await http.get("/admin/cluster")
        assert r.status_code == 200, r.text
        view = r.json()
        assert view["mode"] == "ray" and view["storage_id"] == "store-1"
        nodes = {n["host"]: n for n in view["nodes"]}
        assert nodes["n2"]["storage"] == "shared" and nodes["n3"]["storage"] == "local"
        engine = nodes["n2"]["engines"][0]
        assert engine["name"] == "n2/engine-0"
        assert engine["models_loaded"] is None  # the front has no client for it: unknown

        r = await http.post("/admin/cluster/drain", json={"host": "n2"})
        assert r.status_code == 200, r.text
        assert r.json()["draining"] is True and provider.reports["n2"].draining
        r = await http.post("/admin/cluster/drain", json={"host": "n2", "drain": False})
        assert r.json()["draining"] is False and not provider.reports["n2"].draining

        r = await http.post("/admin/cluster/drain", json={"host": "nope"})
        assert r.status_code == 404 and r.json()["error"] == "node_not_found"
        r = await http.post("/admin/cluster/drain", json={"hosts": "n2"})
        assert r.status_code == 400, r.text  # a client's mistake: 4xx with a code
        assert r.json()["error"] == "invalid_request"


async def test_the_cluster_commands_call_the_admin_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`modelyard cluster status` / `drain` against the front, with the CLI's admin token."""
    provider = FakeCluster()
    async with front(tmp_path / "home", provider) as http:
        url = str(http.base_url)
        monkeypatch.setenv("MODELYARD_TOKEN", http.headers["Authorization"].split()[1])
        monkeypatch.setattr(cli_cluster, "console", Console(width=200))  # no cut cells
        runner = CliRunner()

        async def invoke(args: list[str]) -> Result:
            return await asyncio.to_thread(runner.invoke, app, args)

        drained = await invoke(["cluster", "drain", "n3", "--url", url])
        assert drained.exit_code == 0, drained.output
        assert "n3 is draining" in drained.stdout and provider.reports["n3"].draining
        shown = await invoke(["cluster", "status", "--url", url])
        assert shown.exit_code == 0, shown.output
        n3 = next(line for line in shown.stdout.splitlines() if "n3" in line)
        assert "10.0.0.3" in n3 and "yes" in n3 and "local" in n3
        missing = await invoke(["cluster", "drain", "nope", "--url", url])
        assert missing.exit_code == 1 and "no node 'nope'" in missing.stderr
        monkeypatch.setenv("MODELYARD_TOKEN", "wrong")
        refused = await invoke(["cluster", "status", "--url", url])
        assert refused.exit_code == 1
