"""The engine keeps an idle connection from the front open longer than the front pools it, so a
call never lands on a connection the engine is closing (uvicorn's 5 s default made a swap-heavy
benchmark fail with 503 engine_unavailable and a health probe with RemoteProtocolError)."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator

import pytest
from tests.integration.harness import config, engine_access, module_server
from tests.support import Server, fake_model

from modelyard.serving import (
    ENGINE_CLIENT_KEEPALIVE_S,
    ENGINE_SERVER_KEEPALIVE_S,
    PUBLIC_KEEPALIVE_S,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with module_server(tmp_path_factory, config(fake_model("idle"))) as s:
        yield s


def health_request(port: int, secret: str) -> bytes:
    return (f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {secret}\r\n\r\n").encode()


def ask_health(sock: socket.socket, request: bytes) -> bytes:
    """One whole response: the head and the body may come in separate segments, and a byte left
    unread would look like the engine talking while idle."""
    sock.sendall(request)
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += receive(sock)
    head, body = answer.split(b"\r\n\r\n", 1)
    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    assert length, head
    while len(body) < int(length.group(1)):
        body += receive(sock)
    assert len(body) == int(length.group(1)), answer
    return answer


def receive(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    assert chunk, "the engine closed the connection"
    return chunk


def test_the_engine_outlasts_the_fronts_pool() -> None:
    assert ENGINE_SERVER_KEEPALIVE_S > ENGINE_CLIENT_KEEPALIVE_S


def test_an_idle_connection_to_the_engine_stays_open_past_uvicorns_default(
    server: Server,
) -> None:
    port, secret, _ = engine_access(server)
    health = health_request(port, secret)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        assert ask_health(sock, health).startswith(b"HTTP/1.1 200")
        # Idle past the public keep-alive: the engine must neither close nor send anything.
        sock.settimeout(PUBLIC_KEEPALIVE_S + 2)
        with pytest.raises(TimeoutError):
            sock.recv(1)
        sock.settimeout(5)
        assert ask_health(sock, health).startswith(b"HTTP/1.1 200")
