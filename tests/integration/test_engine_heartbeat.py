"""A stopped engine is found within seconds (the lease channel's heartbeat), not when the health
probes finally kill it: the probe that found this SIGSTOPped an engine and its next request hung
26 s before its 503. Now, within `engine_heartbeat_timeout_s` (3 s by default, left at its default
here), requests waiting on it get 503 engine_unavailable or go to another engine, its streams end
with an in-band error, and it comes back up when it answers again (SIGCONT)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tests.integration.harness import (
    HELLO,
    TEXT_16,
    config,
    leases_back,
    status,
    stream_events,
)
from tests.support import Server, fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

# The default heartbeat timeout (3 s) and a ping interval (a quarter of it), with room for a
# busy 2-core machine; far below the ~20 s the health probes' defaults take to kill it.
FOUND_WITHIN_S = 5.0


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[float]:
    """SIGSTOP `pid` (alive, holding its sockets, answering nothing); SIGCONT however the test
    ends. Yields when it was stopped."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def chat_in_thread(url: str, model: str) -> tuple[threading.Thread, dict[str, Any]]:
    """POST a non-streamed chat on a thread; the result gets `response` and `elapsed_s`."""
    result: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        result["response"] = httpx.post(url + "/v1/chat/completions",
                                        json={"model": model, "messages": HELLO}, timeout=60)
        result["elapsed_s"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def engine_named(server: Server, name: str) -> dict[str, Any]:
    return next(e for e in status(server)["engines"] if e["name"] == name)


def test_a_stopped_engine_ends_its_streams_and_answers_503_within_seconds(
    start_server: Any,
) -> None:
    server = start_server(config(fake_model("m1"), fake_model("slow", "--tokens-per-s", "5")))
    assert httpx.post(server.url + "/v1/chat/completions",
                      json={"model": "m1", "messages": HELLO}, timeout=30).status_code == 200
    pid = int(status(server)["engines"][0]["pid"])

    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = {"model": "slow", "messages": HELLO, "stream": True, "max_tokens": 200}
        with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            assert stream.status_code == 200
            chunks = stream.iter_raw()
            first = next(chunks)
            with stopped(pid) as t0:
                waiting, result = chat_in_thread(server.url, "m1")
                # The model's own server still streams; the engine that leased it is gone.
                text = (first + b"".join(chunks)).decode()
                stream_ended_s = time.monotonic() - t0
                waiting.join(30)
                answered_s = time.monotonic() - t0
                # Down while silent: reports say so at once instead of hanging on it.
                t1 = time.monotonic()
                engine = status(server)["engines"][0]
                assert time.monotonic() - t1 < 2.0
                assert engine["up"] is False and "silent" in engine["error"], engine
                assert httpx.get(server.url + "/health", timeout=5).json()["status"] == "degraded"

    events = stream_events("openai", text)
    assert events[-1]["error"]["code"] == "engine_unavailable", events[-1]
    assert stream_ended_s < FOUND_WITHIN_S, stream_ended_s
    r = result["response"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
    assert "retry-after" in r.headers
    assert answered_s < FOUND_WITHIN_S, answered_s

    # SIGCONT: the same engine answers again (it was not killed) and serves.
    def served() -> bool:
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"model": "m1", "messages": HELLO}, timeout=30)
        return r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == TEXT_16

    poll(served, timeout_s=30, what="the engine to answer again")
    assert status(server)["engines"][0]["pid"] == pid
    leases_back(server, "slow")  # the ended stream gave its lease back


def test_a_request_waiting_on_a_stopped_engine_goes_to_another(start_server: Any) -> None:
    cold = fake_model("cold", "--load-time-s", "3")
    server = start_server(config(cold, simulate_gpus="2x8GiB", engine_devices="per_gpu",
                                 default_engine=0))
    pid = int(engine_named(server, "engine-0")["pid"])
    waiting, result = chat_in_thread(server.url, "cold")
    poll(lambda: any(m["model"] == "cold" and m["state"] == "loading"
                     for m in engine_named(server, "engine-0")["models"]),
         timeout_s=20, what="cold to load on engine-0")
    with stopped(pid) as t0:
        waiting.join(30)
        rerouted_s = time.monotonic() - t0
        r = result["response"]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == TEXT_16
        held = [m["model"] for m in engine_named(server, "engine-1")["models"]
                if m["state"] == "ready"]
        assert held == ["cold"]
    # Found silent within seconds, then a load of 3 s on engine-1.
    assert rerouted_s < FOUND_WITHIN_S + 3 + 3, rerouted_s
