"""Only the front may drive its engines (DESIGN.md §3.12). The probe that found this ran commands as
the server's user through an engine's loopback API: `POST /reload` with a model whose argv is a
shell command (as text/plain, which a web page can send without a preflight), then
`POST /models/<id>/load`; and any raw socket got leases on the lease channel. Here the same is
tried with raw HTTP and a raw TCP lease line against a real engine process: without the engine's
secret, with the wrong Host, with a text/plain body, then with everything right."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.harness import (
    HELLO,
    config,
    engine_access,
    model_status,
    module_server,
    process_env,
)
from tests.support import Server, fake_model, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with module_server(tmp_path_factory, config(fake_model("m1"))) as s:
        yield s


@pytest.fixture(scope="module")
def engine(server: Server) -> tuple[int, str, int]:
    return engine_access(server)


def raw_http(port: int, method: str, path: str, headers: dict[str, str],
             body: bytes = b"") -> tuple[int, Any]:
    """One hand-written HTTP/1.1 request; the status and the JSON body of the answer."""
    head = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items()),
            f"Content-Length: {len(body)}", "Connection: close", "", ""]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall("\r\n".join(head).encode() + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    payload = rest.split(b"\r\n\r\n", 1)[1]
    return int(status_line.split()[1]), json.loads(payload) if payload else None


def attack_settings(marker: Path) -> bytes:
    """The probe's payload: a configuration whose model runs a shell command when loaded."""
    pwn = {"id": "pwn", "argv": ["sh", "-c", f"id > {marker}"]}
    return json.dumps({"scan_hf_cache": False, "models": [pwn]}).encode()


def test_without_the_secret_every_route_is_refused(engine: tuple[int, str, int]) -> None:
    port, _, _ = engine
    host = {"Host": f"127.0.0.1:{port}"}
    for method, path in [("GET", "/health"), ("GET", "/status"), ("GET", "/diag"),
                         ("GET", "/doctor"),
                         ("POST", "/rescan"), ("POST", "/models/m1/load"),
                         ("POST", "/models/m1/unload"), ("POST", "/reload"),
                         ("GET", "/logs?model=m1"), ("GET", "/logs/stream?model=m1"),
                         ("GET", "/kv/m1/slots"), ("POST", "/kv/m1/slots/0"),
                         ("POST", "/kv/drop")]:
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "wrong"}):
            status, body = raw_http(port, method, path,
                                    {**host, **auth, "Content-Type": "application/json"})
            assert (status, body["error"]) == (401, "unauthorized"), (method, path, auth, body)


def test_the_probes_attack_runs_nothing(
    server: Server, engine: tuple[int, str, int], tmp_path: Path
) -> None:
    port, _, _ = engine
    marker = tmp_path / "pwned"
    host = {"Host": f"127.0.0.1:{port}"}
    # What a page in a browser can send to a loopback port: text/plain, no credentials.
    status, body = raw_http(port, "POST", "/reload", {**host, "Content-Type": "text/plain"},
                            attack_settings(marker))
    assert (status, body["error"]) == (401, "unauthorized")
    status, body = raw_http(port, "POST", "/models/pwn/load", host)
    assert (status, body["error"]) == (401, "unauthorized")
    assert not marker.exists()
    assert model_status(server, "pwn") is None


def test_a_foreign_host_is_refused_even_with_the_secret(engine: tuple[int, str, int]) -> None:
    port, secret, _ = engine
    auth = {"Authorization": f"Bearer {secret}"}
    # A DNS-rebound page names its own host; a right name needs this engine's port too.
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1", f"127.0.0.1:{port + 1}",
                 f"localhost.evil.example:{port}"):
        status, body = raw_http(port, "GET", "/health", {"Host": host, **auth})
        assert (status, body["error"]) == (421, "host_not_allowed"), (host, body)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}"):
        status, _ = raw_http(port, "GET", "/health", {"Host": host, **auth})
        assert status == 200, host


def test_a_body_that_is_not_json_is_refused_even_with_the_secret(
    server: Server, engine: tuple[int, str, int], tmp_path: Path
) -> None:
    port, secret, _ = engine
    marker = tmp_path / "pwned"
    headers = {"Host": f"127.0.0.1:{port}", "Authorization": f"Bearer {secret}"}
    for content_type in ("text/plain", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", None):
        sent = {**headers, "Content-Type": content_type} if content_type else headers
        status, body = raw_http(port, "POST", "/reload", sent, attack_settings(marker))
        assert (status, body["error"]) == (415, "unsupported_media_type"), content_type
    status, body = raw_http(port, "POST", "/rescan", headers)  # no body still says JSON
    assert (status, body["error"]) == (415, "unsupported_media_type")
    assert not marker.exists() and model_status(server, "pwn") is None


def test_the_right_secret_host_and_type_work(engine: tuple[int, str, int]) -> None:
    port, secret, _ = engine
    headers = {"Host": f"127.0.0.1:{port}", "Authorization": f"Bearer {secret}",
               "Content-Type": "application/json; charset=utf-8"}
    status, body = raw_http(port, "GET", "/health", headers)
    assert status == 200 and body["lease_port"] > 0
    status, body = raw_http(port, "POST", "/rescan", headers)
    assert status == 200 and body["models"] >= 1


def lease_line(port: int, *lines: bytes) -> bytes:
    """Send `lines` on a raw lease-channel connection; everything the engine sent back before
    it closed the connection (or stayed silent for 3 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"".join(lines))
        sock.settimeout(3)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except TimeoutError:
            answer += b"<open>"
    return answer


def test_the_lease_channel_grants_only_to_a_hello_with_the_secret(
    server: Server, engine: tuple[int, str, int]
) -> None:
    port, secret, _ = engine
    _, health = raw_http(port, "GET", "/health", {"Host": f"127.0.0.1:{port}",
                                                  "Authorization": f"Bearer {secret}"})
    lease_port = int(health["lease_port"])
    acquire = b'{"op": "acquire", "id": 1, "model": "m1"}\n'
    for hello in (b"", b'{"op": "hello", "protocol": 1}\n',
                  b'{"op": "hello", "secret": "guess", "protocol": 1}\n'):
        # Closed without a word: no grant, no error naming models.
        assert lease_line(lease_port, hello, acquire) == b"", hello
    assert model_status(server, "m1") is None or model_status(server, "m1")["leases"] == 0

    right = b'{"op": "hello", "secret": "%s", "protocol": 1}\n' % secret.encode()
    answer = lease_line(lease_port, right, acquire)
    assert answer.startswith(b'{"op":"hello","protocol":1}\n') and b'"lease"' in answer


def test_the_secret_is_in_no_command_line_and_not_inherited_by_models(
    server: Server, engine: tuple[int, str, int]
) -> None:
    _, secret, pid = engine
    assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert secret.encode() not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "m1", "messages": HELLO},
                   timeout=30)
    assert r.status_code == 200, r.text  # the front itself gets through
    child = model_status(server, "m1")
    assert child is not None and child["pid"]
    assert "MODELYARD_ENGINE_SECRET" not in process_env(int(child["pid"]))


def test_an_engine_started_without_a_secret_refuses_to_serve(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MODELYARD_ENGINE_SECRET"}
    env["MODELYARD_HOME"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "modelyard", "serve", "--engine-only",
         "--internal-port", str(free_port())],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "MODELYARD_ENGINE_SECRET" in done.stderr
