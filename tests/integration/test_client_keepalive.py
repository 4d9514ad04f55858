"""`client_keep_alive_s`: how long the front keeps an idle client connection. uvicorn's 5 s was
fixed, so a front could not hold many idle keep-alive clients (make bench-load holds 1,000 for
minutes), nor close them sooner."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from tests.integration.harness import config, module_server
from tests.integration.test_engine_keepalive import ask_health
from tests.support import Server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with module_server(tmp_path_factory, config(client_keep_alive_s=1)) as s:
        yield s


def test_the_front_closes_an_idle_client_connection_after_client_keep_alive_s(
    server: Server,
) -> None:
    request = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        assert ask_health(sock, request).startswith(b"HTTP/1.1 200")
        idle_from = time.monotonic()
        sock.settimeout(4)  # well under uvicorn's 5 s default
        assert sock.recv(1) == b"", "the front sent something on an idle connection"
        assert time.monotonic() - idle_from >= 0.5  # kept while idle, then closed
