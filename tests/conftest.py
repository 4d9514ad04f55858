"""Shared fixtures (helpers live in tests/support.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.support import FAKE_BACKEND, Server, fake_model, free_port

__all__ = ["FAKE_BACKEND", "Server", "fake_model", "free_port", "start_server"]


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
