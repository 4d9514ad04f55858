"""Graceful shutdown of `modelyard serve` (front, engine and model processes):

* SIGTERM stops every process the server started and frees every port they listened on; an open
  feed (a log tail) does not hold it up;
* the front stops accepting at once, and streams that finish within `shutdown_grace_s` finish;
* what outlives the grace ends in its API's shape: an in-band error event in a stream (also one
  still waiting for its model to load), a 503 `shutting_down` for a response not yet begun;
* a second signal exits at once, still leaving no process behind.

Each test needs a server of its own.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from typing import Any

import httpx
import psutil
import pytest
from tests.integration.harness import HELLO, chat_request, config, event_text, status, stream_events
from tests.support import Server, fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

APIS = ("openai", "ollama", "native")


def tree(pid: int) -> list[psutil.Process]:
    """The process and every descendant, as psutil handles (they notice pid reuse)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def listening_ports(procs: list[psutil.Process]) -> set[int]:
    return {c.laddr.port for p in procs for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def can_bind(port: int) -> bool:
    """Whether a new server could listen on `port` (SO_REUSEADDR, as servers bind: closed
    connections in TIME_WAIT do not count, a listener does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def refuses(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        try:
            s.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
        return False


def assert_all_gone(procs: list[psutil.Process], ports: set[int]) -> None:
    poll(lambda: all(gone(p) for p in procs), timeout_s=10,
         what=f"every process to exit: {[p.pid for p in procs if not gone(p)]}")
    assert all(can_bind(port) for port in ports), [p for p in ports if not can_bind(p)]


def warm(server: Server, model: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": model, "messages": HELLO, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text


class Call(threading.Thread):
    """One request on a thread: its status, its body as it streamed, and when it ended."""

    def __init__(self, url: str, path: str, body: dict[str, Any], **kw: Any) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.body, self.kw = url + path, path, body, kw
        self.first_byte = threading.Event()
        self.status = 0
        self.headers: dict[str, str] = {}
        self.text = ""
        self.ended_at = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=60, **self.kw) as r:
                self.status, self.headers = r.status_code, dict(r.headers)
                for chunk in r.iter_raw():
                    self.text += chunk.decode()
                    self.first_byte.set()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.first_byte.set()

    def finish(self) -> Call:
        self.join(30)
        assert not self.is_alive() and self.error is None, (self.path, self.error)
        return self


def stream_call(server: Server, api: str, model: str, max_tokens: int) -> Call:
    path, body = chat_request(api, model, stream=True, max_tokens=max_tokens)
    call = Call(server.url, path, body)
    call.start()
    return call


def test_sigterm_stops_every_process_and_frees_every_port(start_server: Any) -> None:
    server = start_server(config(fake_model("m1"), shutdown_grace_s=30))
    warm(server, "m1")
    procs = tree(server.proc.pid)
    assert len(procs) >= 3, procs  # the front, its engine, the engine's model server
    ports = listening_ports(procs)
    assert server.port in ports and len(ports) >= 4  # + the engine's HTTP and lease ports

    # A feed never ends by itself; it must not hold the shutdown for the grace.
    with httpx.stream("GET", server.url + "/admin/logs/stream", headers=server.admin_headers,
                      timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)
        t0 = time.monotonic()
        os.kill(server.proc.pid, signal.SIGTERM)
        for _ in lines:  # it ends (cleanly) when the shutdown begins
            pass
    server.proc.wait(20)
    assert time.monotonic() - t0 < 10
    assert_all_gone(procs, ports)


def test_streams_that_finish_within_the_grace_complete(start_server: Any) -> None:
    tokens = 20  # 2 s at 10 tokens/s
    server = start_server(config(fake_model("m1", "--tokens-per-s", "10"), shutdown_grace_s=15))
    warm(server, "m1")
    procs = tree(server.proc.pid)
    ports = listening_ports(procs)
    calls = {api: stream_call(server, api, "m1", tokens) for api in APIS}
    for call in calls.values():
        assert call.first_byte.wait(15)

    t0 = time.monotonic()
    os.kill(server.proc.pid, signal.SIGTERM)
    poll(lambda: refuses(server.port), timeout_s=2, what="the front to stop accepting")
    assert any(c.is_alive() for c in calls.values())  # it stopped accepting before they ended

    for api, call in calls.items():
        call.finish()
        assert call.status == 200
        events = stream_events(api, call.text)
        text = "".join(event_text(api, e) for e in events)
        assert len(text.split()) == tokens, (api, call.text)
        assert not any(isinstance(e, dict) and "error" in e for e in events), (api, events)
        assert events[-1] == "[DONE]" if api == "openai" else events[-1]["done"] is True
    server.proc.wait(20)
    assert time.monotonic() - t0 < 10  # it did not wait out the grace
    assert_all_gone(procs, ports)


def test_what_outlives_the_grace_ends_in_its_apis_shape(start_server: Any) -> None:
    grace_s = 1.5
    server = start_server(config(
        fake_model("m1", "--tokens-per-s", "4"), fake_model("cold", "--load-time-s", "60"),
        shutdown_grace_s=grace_s, notify_model_swap=True,
    ))
    warm(server, "m1")
    procs = tree(server.proc.pid)
    ports = listening_ports(procs)
    streams = {api: stream_call(server, api, "m1", 400) for api in APIS}  # 100 s each
    # A stream waiting for its model to load has begun (swap progress); a plain request that
    # waits for the same load has not.
    loading = stream_call(server, "ollama", "cold", 10)
    assert loading.first_byte.wait(15)
    path, body = chat_request("openai", "cold", stream=False)
    waiting = Call(server.url, path, body)
    waiting.start()
    poll(lambda: status(server)["queues"].get("cold", {}).get("running") == 2, timeout_s=10,
         what="both requests for the cold model to be waiting for its load")
    for call in streams.values():
        assert call.first_byte.wait(15)

    t0 = time.monotonic()
    os.kill(server.proc.pid, signal.SIGTERM)
    for api, call in streams.items():
        call.finish()
        assert call.status == 200
        events = stream_events(api, call.text)
        assert "".join(event_text(api, e) for e in events)  # it had streamed text
        last = events[-1]  # the in-band error event, in the API's own shape
        if api == "openai":
            assert last["error"]["code"] == "shutting_down", last
        elif api == "native":
            assert last["error"] == "shutting_down" and last["retryable"] is True, last
        else:
            assert set(last) == {"error"} and "shutting down" in last["error"], last
        assert "shutdown_grace_s" in str(last)
    loading.finish()
    lines = stream_events("ollama", loading.text)
    assert "loading cold" in lines[0]["message"]["thinking"]
    assert set(lines[-1]) == {"error"} and "shutting down" in lines[-1]["error"]
    waiting.finish()
    assert waiting.status == 503 and int(waiting.headers["retry-after"]) >= 1
    assert waiting.headers["content-type"] == "application/json"
    err = json.loads(waiting.text)["error"]
    assert err["code"] == "shutting_down" and err["type"] == "server_error"
    for call in (*streams.values(), loading, waiting):
        assert grace_s <= call.ended_at - t0 < grace_s + 3, call.path

    server.proc.wait(20)
    assert time.monotonic() - t0 < grace_s + 15
    assert_all_gone(procs, ports)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_exits_at_once(start_server: Any, sig: signal.Signals) -> None:
    server = start_server(config(fake_model("m1", "--tokens-per-s", "4", "--ignore-sigterm"),
                                 shutdown_grace_s=60, stop_grace_s=30))
    warm(server, "m1")
    procs = tree(server.proc.pid)
    ports = listening_ports(procs)
    call = stream_call(server, "openai", "m1", 400)
    assert call.first_byte.wait(15)

    os.kill(server.proc.pid, sig)
    poll(lambda: refuses(server.port), timeout_s=2, what="the front to start shutting down")
    assert server.proc.poll() is None  # it waits for the stream
    t0 = time.monotonic()
    os.kill(server.proc.pid, sig)
    code = server.proc.wait(10)
    assert time.monotonic() - t0 < 3
    assert code == 128 + sig
    call.join(10)
    assert not call.is_alive()
    assert_all_gone(procs, ports)  # even a model server that ignores SIGTERM
