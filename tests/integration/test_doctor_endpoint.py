"""`GET /admin/doctor` through a real front and its engine process (the engine's own
`GET /doctor` over its authenticated API), on a simulated GPU with a fake llama-server built
for the CPU: admin only, and the report says the GPU is simulated, what llama-server lists and
the fix; `modelyard doctor` asks that server when one answers."""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.integration.harness import config, module_server
from tests.support import Server, fake_model
from typer.testing import CliRunner

from modelyard.cli.main import app
from modelyard.wire.doctor import DoctorReport

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

LISTING = Path(__file__).parent.parent / "data" / "list_devices" / "cpu_only.txt"
DOCTOR_TIMEOUT_S = 150.0  # the engine imports torch in a child process to answer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    binary = tmp_path_factory.mktemp("bin") / "llama-server"
    binary.write_text("#!/bin/sh\n"
                      'case "$1" in\n'
                      f"  --list-devices) cat '{LISTING}' ;;\n"
                      "  --version) echo 'version: 4242 (cpu fake)' >&2 ;;\n"
                      "  *) exit 1 ;;\n"
                      "esac\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    cfg = config(fake_model("m1"), devices="auto", llama_server_path=str(binary))
    with module_server(tmp_path_factory, cfg, "--simulate-gpus", "1x8GiB") as s:
        yield s


def test_the_doctor_is_admin_only(server: Server) -> None:
    assert httpx.get(server.url + "/admin/doctor", timeout=30).status_code == 401
    made = httpx.post(server.url + "/tokens", headers=server.admin_headers, timeout=30,
                      json={"name": "doctor-inference", "scopes": ["inference"]})
    assert made.status_code == 201, made.text
    inference = {"Authorization": f"Bearer {made.json()['token']}"}
    r = httpx.get(server.url + "/admin/doctor", headers=inference, timeout=30)
    assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text


def test_the_report_asks_the_engine_and_adds_the_host(server: Server) -> None:
    r = httpx.get(server.url + "/admin/doctor", headers=server.admin_headers,
                  timeout=DOCTOR_TIMEOUT_S)
    assert r.status_code == 200, r.text
    report = DoctorReport.model_validate(r.json())
    assert report.source == "server"
    (engine,) = report.engines
    assert engine.engine == "engine-0" and engine.up and engine.simulated
    assert [(g.name, g.total_bytes, g.simulated) for g in engine.gpus] == [
        ("simulated GPU 0", 8 * 1024**3, True)]
    assert engine.nvml.per_process == "simulated"
    assert engine.llama_server.version == "version: 4242 (cpu fake)"
    assert engine.llama_server.devices == ()
    assert engine.torch.installed and engine.torch.cuda_available is not None  # asked, not read
    assert report.host.ram_total_bytes > 0 and report.disks
    assert any(str(server.home) in d.path or d.path in str(server.home) for d in report.disks)
    problem = next(p for p in report.problems if p.code == "llama_server_no_gpu")
    assert problem.engines == ("engine-0",) and problem.severity == "info"  # simulated
    assert "llama_server_path" in problem.fix and "MODELYARD_ACCEL=cuda" in problem.fix


def test_the_command_asks_the_running_server(server: Server) -> None:
    env = {"MODELYARD_HOME": str(server.home)}  # the CLI's admin token is there
    result = CliRunner().invoke(app, ["doctor", "--url", server.url, "--json"], env=env)
    report = DoctorReport.model_validate(json.loads(result.output))
    assert report.source == "server" and report.engines[0].engine == "engine-0"
    result = CliRunner().invoke(app, ["doctor", "--url", server.url], env=env)
    assert f"asked the server at {server.url}" in " ".join(result.output.split())
