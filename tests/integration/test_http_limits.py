"""Head size, header count and read timeouts (src/modelyard/http_limits.py), over raw sockets to
a real `modelyard serve` — its public port and its engine's loopback port: an oversized head
gets 431 and the front's memory does not grow by what the client sent, too many header fields get
431, a slowloris client and a stalled body upload are cut off within the configured timeouts,
and ordinary keep-alive traffic is unaffected."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator

import psutil
import pytest
from tests.integration.harness import config, module_server
from tests.support import Server, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

HEAD_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 2.0
MAX_HEADER_BYTES = 64 * 1024  # the default
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = config(header_read_timeout_s=HEAD_TIMEOUT_S, body_read_timeout_s=BODY_TIMEOUT_S)
    with module_server(tmp_path_factory, cfg) as s:
        yield s


def engine_port(server: Server) -> int:
    def found() -> int | None:
        for child in psutil.Process(server.proc.pid).children(recursive=True):
            argv = child.cmdline()
            if "--engine-only" in argv:
                return int(argv[argv.index("--internal-port") + 1])
        return None

    return poll(found, what="the engine process")


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def read_answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset after its answer ends it too)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def read_response(sock: socket.socket) -> bytes:
    """One whole response on a kept-alive connection (its head, then Content-Length bytes)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data[:200]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data[:200]!r}"
        body += chunk
    assert len(body) == length, "more than one response"
    return head + b"\r\n\r\n" + body


def status_and_body(answer: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), answer[:200]
    return int(head.split()[1]), json.loads(body)


def send_until_answered(sock: socket.socket, head: bytes, filler: int, chunk: int) -> int:
    """Send `head`, then up to `filler` bytes of one header value, stopping as soon as the server
    answers or closes; returns how much was sent."""
    sock.sendall(head)
    sent = len(head)
    block = b"a" * chunk
    while sent < len(head) + filler:
        try:
            sock.sendall(block)
        except (BrokenPipeError, ConnectionResetError):
            return sent
        sent += chunk
        if select.select([sock], [], [], 0.005)[0]:
            return sent
    return sent


@pytest.mark.parametrize("which", ["front", "engine"])
def test_a_complete_head_over_the_limit_gets_431(server: Server, which: str) -> None:
    port = server.port if which == "front" else engine_port(server)
    with connect(port) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
                     + b"a" * (MAX_HEADER_BYTES + 1000) + b"\r\n\r\n")
        status, body = status_and_body(read_answer(sock))
    assert status == 431
    assert body["error"] == {
        "message": f"the request head is larger than {MAX_HEADER_BYTES} bytes",
        "type": "invalid_request_error", "param": None, "code": "header_fields_too_large",
    }


def test_unfinished_16_mib_heads_are_cut_off_without_growing_the_front(server: Server) -> None:
    front = psutil.Process(server.proc.pid)
    before = front.memory_info().rss
    answers = []
    for _ in range(4):
        with connect(server.port) as sock:
            sent = send_until_answered(sock, b"GET /health HTTP/1.1\r\nX-Big: ", 16 * MIB, 16384)
            answers.append(read_answer(sock))
        assert sent < 4 * MIB, "the server kept reading an oversized head"
    grown = front.memory_info().rss - before
    assert grown < 16 * MIB, f"the front grew by {grown} bytes"
    for answer in answers:
        status, body = status_and_body(answer)
        assert (status, body["error"]) == (431, "header_fields_too_large")


@pytest.mark.parametrize("which", ["front", "engine"])
def test_too_many_header_fields_get_431(server: Server, which: str) -> None:
    port = server.port if which == "front" else engine_port(server)
    fields = b"".join(b"X-Field-%d: %d\r\n" % (i, i) for i in range(200))
    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + fields + b"\r\n")
        status, body = status_and_body(read_answer(sock))
    assert status == 431
    assert body["error"] == "header_fields_too_large"
    assert "more than 100 header fields" in str(body["message"])


def test_a_slowloris_client_is_cut_off_within_the_head_timeout(server: Server) -> None:
    with connect(server.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        started = time.monotonic()
        answer = b""
        # The attacker's pace: one header byte a second, for far longer than the timeout.
        while time.monotonic() - started < 5 * HEAD_TIMEOUT_S:
            try:
                sock.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                break
            if select.select([sock], [], [], 1.0)[0]:
                answer = read_answer(sock)
                break
        elapsed = time.monotonic() - started
    assert elapsed < HEAD_TIMEOUT_S + 1.5, f"still connected after {elapsed:.1f} s"
    status, body = status_and_body(answer)
    assert (status, body["error"]) == (408, "request_timeout")


def test_a_silent_connection_is_closed_within_the_head_timeout(server: Server) -> None:
    with connect(server.port) as sock:
        started = time.monotonic()
        assert read_answer(sock) == b""
        assert time.monotonic() - started < HEAD_TIMEOUT_S + 1.5


def test_a_stalled_body_upload_gets_408(server: Server) -> None:
    with connect(server.port) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\"")
        started = time.monotonic()
        status, body = status_and_body(read_answer(sock))
        elapsed = time.monotonic() - started
    assert elapsed < BODY_TIMEOUT_S + 1.5
    assert status == 408
    error = body["error"]
    assert isinstance(error, dict) and error["code"] == "request_timeout"


def test_ordinary_keep_alive_traffic_passes(server: Server) -> None:
    """A 32 KiB cookie, a body sent in pieces within the timeouts, three requests on one
    connection: all answered."""
    with connect(server.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nCookie: c="
                     + b"x" * 32768 + b"\r\n\r\n")
        first = read_response(sock)
        assert first.startswith(b"HTTP/1.1 200"), first[:200]
        body = b'{"model": "nothing", "messages": []}'
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body[:10])
        time.sleep(BODY_TIMEOUT_S / 2)  # a slow client's pause, within the timeout
        sock.sendall(body[10:])
        second = read_response(sock)
        assert second.startswith(b"HTTP/1.1 4"), second[:200]  # the app's answer, not ours
        assert b"request_timeout" not in second
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
