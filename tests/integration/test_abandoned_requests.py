"""Requests that must not hold a backend's slot for nothing: a non-streamed request whose client
left, a keep_alive 0 request on a cold model, a text completion that sets no limit.

One `modelyard serve` is shared by the module; every test has models of its own. The client
leaves over a raw socket (closed once the backend is generating), and the fake llama-server's
/stats say whether it went on generating.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.harness import HELLO, config, model_status, module_server, starts
from tests.support import Server, backend_headers, fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

PATHS = ("/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate", "/chat")


def body(path: str, model: str, tokens: int) -> dict[str, Any]:
    """A non-streamed request for `tokens` tokens in the path's own dialect."""
    out: dict[str, Any] = {"model": model, "stream": False}
    prompt = path in ("/v1/completions", "/api/generate")
    out.update({"prompt": "Say hello"} if prompt else {"messages": HELLO})
    out.update({"options": {"num_predict": tokens}} if path.startswith("/api/")
               else {"max_tokens": tokens})
    return out


def slow_id(path: str) -> str:
    return "slow" + path.replace("/", "-")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, files: Path) -> Iterator[Server]:
    # The others are kept forever: the keep-alive reaper then sleeps with no deadline, as on an
    # engine where nothing else is loaded, which is when it used to beat a request to its lease.
    models = [
        *(fake_model(slow_id(path), "--tokens-per-s", "5", keep_alive_s=-1) for path in PATHS),
        fake_model("ka0", "--load-time-s", "0.3", "--start-log", str(files / "ka0.starts")),
        fake_model("plain", keep_alive_s=-1),
    ]
    presets = [{"id": "long-plain", "model": "plain", "parameters": {"max_tokens": 40}}]
    with module_server(tmp_path_factory, config(*models, presets=presets)) as s:
        yield s


def send_raw(server: Server, path: str, body: dict[str, Any]) -> socket.socket:
    """A request sent over a socket of our own, so the test decides when the client leaves."""
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(head.encode() + payload)
    return sock


def requests_counted(server: Server, model: str, status: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("modelyard_requests_total{") and f'model="{model}"' in line \
                and f'status="{status}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("path", PATHS)
def test_a_client_leaving_a_non_streamed_request_stops_its_generation(
    server: Server, path: str
) -> None:
    model = slow_id(path)
    # Warm: a request for a model that is ready is sent at once, with nothing else waiting.
    r = httpx.post(server.url + path, json=body(path, model, 1), timeout=30)
    assert r.status_code == 200, r.text
    sock = send_raw(server, path, body(path, model, 500))  # 100 s at 5 tokens/s
    try:
        leased = poll(lambda: (m := model_status(server, model)) and m["leases"] == 1 and m,
                      timeout_s=20, what="the request to hold its lease")
        upstream = leased["upstream"]
        poll(lambda: httpx.get(upstream + "/stats", timeout=10).json()["active"] == 1,
             timeout_s=10, what="the backend to be generating")
    finally:
        sock.close()  # the client gives up before the answer

    def cancelled() -> dict[str, Any] | None:
        stats = httpx.get(upstream + "/stats", timeout=10).json()
        return stats if stats["requests_cancelled"] == 1 and stats["active"] == 0 else None

    stats = poll(cancelled, timeout_s=10, what="the backend to see the request cancelled")
    assert stats["requests_started"] == 2 and stats["requests_completed"] == 1
    slots = httpx.get(upstream + "/slots", headers=backend_headers(server.home, model), timeout=10)
    assert slots.json() == [{"id": 0, "is_processing": False}]
    poll(lambda: model_status(server, model)["leases"] == 0, timeout_s=10, what="lease released")
    poll(lambda: requests_counted(server, model, "client_closed_request") == 1, timeout_s=10,
         what="the request counted as closed by its client")
    # The model stays loaded and serves the next request.
    r = httpx.post(server.url + path, json=body(path, model, 1), timeout=30)
    assert r.status_code == 200, r.text


def test_keep_alive_zero_on_a_cold_model_loads_once_serves_then_unloads(
    server: Server, files: Path
) -> None:
    assert model_status(server, "ka0") is None  # cold
    request = {"model": "ka0", "prompt": "Say hello", "keep_alive": 0, "stream": False}
    r = httpx.post(server.url + "/api/generate", json=request, timeout=20)
    assert r.status_code == 200, r.text
    assert r.json()["done"] is True and r.json()["response"]
    poll(lambda: model_status(server, "ka0")["state"] == "stopped", timeout_s=10,
         what="the unload once the request was served")
    assert len(starts(files / "ka0.starts")) == 1  # one load, not one a second


def test_a_text_completion_without_a_limit_gets_default_max_tokens(server: Server) -> None:
    def sent_upstream(request: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(server.url + "/v1/completions", json=request, timeout=30)
        assert r.status_code == 200, r.text
        upstream = model_status(server, "plain")["upstream"]  # type: ignore[index]
        return dict(httpx.get(upstream + "/requests", timeout=10).json()[-1])

    assert sent_upstream({"model": "plain", "prompt": "Hi"})["max_tokens"] == 16
    assert sent_upstream({"model": "plain", "prompt": "Hi", "max_tokens": None})["max_tokens"] == 16
    assert sent_upstream({"model": "plain", "prompt": "Hi", "max_tokens": 3})["max_tokens"] == 3
    got = sent_upstream({"model": "plain", "prompt": "Hi", "n_predict": 5})
    assert got["n_predict"] == 5 and "max_tokens" not in got
    assert sent_upstream({"model": "long-plain", "prompt": "Hi"})["max_tokens"] == 40  # preset's
    # Chats are left alone: llama-server stops a chat at the end of its turn.
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "plain", "messages": HELLO},
                   timeout=30)
    assert r.status_code == 200
    upstream = model_status(server, "plain")["upstream"]  # type: ignore[index]
    assert "max_tokens" not in httpx.get(upstream + "/requests", timeout=10).json()[-1]
