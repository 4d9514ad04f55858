"""Schemathesis over GET /openapi.json against a real `modelyard serve` (a fake llama-server
backend, a fake service of each kind): every operation gets generated requests, valid and
invalid (examples, boundary values, random), with the admin token, and none may answer 5xx or
hang past the request timeout (a client's mistake is a 4xx with a code; DESIGN.md §3.12).

Bounded: the schemathesis CLI runs with a total time budget (FUZZ_BUDGET_S, default 150 s) and a
request timeout; FUZZ_SEED replays a run, FUZZ_ONLY (a path regex) fuzzes some operations only.
Its report (with a curl line reproducing each failure) is the assertion's message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.fuzz.fuzz_hooks import MODEL, SERVICES
from tests.integration.harness import config, module_server
from tests.support import ROOT, Server, fake_model, free_port, poll

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(600)]

FAKE_SERVICE = ROOT / "tests" / "fakes" / "fake_service.py"
KIND_PATHS = {"speech": "/v1/audio/speech", "transcription": "/v1/audio/transcriptions",
              "image": "/v1/images/generations"}
BUDGET_S = int(os.environ.get("FUZZ_BUDGET_S", "150"))
EXCLUDED = (
    # Endless event streams: they never answer in full (their query parsing is /admin/logs's).
    "/admin/logs/stream", "/studio/events", "/activity/stream",
    # It walks whatever folder it is given: a generated "/" scans the whole disk.
    "/admin/import",
)


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    """One fake service per kind (real processes), as config entries, so the service routes
    relay generated bodies to a service instead of stopping at 'no such model'."""
    logs = tmp_path_factory.mktemp("services")
    procs: list[subprocess.Popen[bytes]] = []
    entries = []
    try:
        for name, kind in SERVICES.items():
            port = free_port()
            with (logs / f"{name}.log").open("w") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, str(FAKE_SERVICE), "--port", str(port), "--kind", kind],
                    stdout=out, stderr=subprocess.STDOUT))
            url = f"http://127.0.0.1:{port}"
            poll(lambda url=url: _answers(url + "/health"), what=f"fake service {name}")
            entries.append({"id": name, "backend": "service", "url": url,
                            "paths": {kind: KIND_PATHS[kind]},
                            "load_path": "/load", "unload_path": "/unload"})
        yield entries
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory,
           services: list[dict[str, Any]]) -> Iterator[Server]:
    # Pulls go nowhere (a closed port) and fail fast instead of reaching the real Hub.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
        mp.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        with module_server(tmp_path_factory, config(fake_model(MODEL), *services)) as s:
            yield s


def schemathesis_argv(server: Server) -> list[str]:
    token = (server.home / "cli-token").read_text().strip()
    argv = [
        sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json",
        "--checks", "not_a_server_error", "--phases", "examples,coverage,fuzzing",
        "--max-time", str(BUDGET_S), "--request-timeout", "20", "--workers", "1",
        "--header", f"Authorization: Bearer {token}", "--generation-database", "none",
        "--no-color", "--suppress-health-check", "all",
    ]
    for path in EXCLUDED:
        argv += ["--exclude-path", path]
    if only := os.environ.get("FUZZ_ONLY"):
        argv += ["--include-path-regex", only]
    if seed := os.environ.get("FUZZ_SEED"):
        argv += ["--seed", seed]
    return argv


def test_no_server_error(server: Server, tmp_path: Path) -> None:
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.fuzz.fuzz_hooks",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # In a scratch folder: the CLI keeps a cache of what failed under its working directory.
    run = subprocess.run(schemathesis_argv(server), cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=BUDGET_S + 240)
    report = run.stdout + run.stderr
    print(report)
    assert "API Operations:" in report, report  # it ran (a broken invocation says otherwise)
    assert run.returncode == 0, report[-20000:]


def test_the_fuzzed_server_is_still_healthy(server: Server) -> None:
    """Runs after the fuzzing (same module, same server): nothing it sent brought it down."""
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 200, r.text
    assert server.proc.poll() is None
