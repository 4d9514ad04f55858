"""Lease churn (issue 31): 64 streaming clients against one model, each one, request after
request, either reading its answer to the end, cutting the stream part-way, giving up after a
random wait (in the queue, while the model loads, at the grant or mid-stream: a client's 120 s
timeout, scaled down), or giving up on a non-streamed request. Afterwards no lease and no queue
slot may be held, and the model must unload on request.

Shared by tests/integration/test_lease_churn.py (seconds, in `make test`) and
tests/soak/test_lease_churn_soak.py (a minute a round, `make soak`). Loopback only; every loop
and every request is bounded.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Any

import httpx
from tests.integration.harness import HELLO, chat_request, config
from tests.support import Server, fake_model

CLIENTS = 64
APIS = ("openai", "ollama", "native")
# What a client may see under this load besides a 200 (docs/troubleshooting.md): the queue is
# full (429) or its wait ran out (503 queue_timeout).
DOCUMENTED = {200, 429, 503}
KINDS = ("finish", "cut", "give_up", "give_up_whole")
REQUEST_CAP_S = 30.0  # no request of a well-behaved client here takes longer
MODEL = "churn"


def churn_config(**settings: Any) -> dict[str, Any]:
    """One fake model that loads in a moment and streams a token every 20 ms, 4 at once: 64
    clients keep its queue full, and a round that starts cold waits for a load. Swap progress on:
    streams that wait for the load hear it (and its own leases are exercised)."""
    model = fake_model(MODEL, "--load-time-s", "0.4", "--tokens-per-s", "50",
                       max_concurrency=4)
    return config(model, max_queue=256, queue_timeout_s=20, notify_model_swap=True, **settings)


async def _one(http: httpx.AsyncClient, rng: random.Random, give_up_s: float,
               seen: Counter[str]) -> None:
    kind = rng.choice(KINDS)
    api = rng.choice(APIS)
    path, body = chat_request(api, MODEL, stream=kind != "give_up_whole",
                              max_tokens=rng.randint(4, 40))
    body["messages"] = HELLO
    limit = rng.uniform(0.0, give_up_s) if kind.startswith("give_up") else REQUEST_CAP_S
    cut_at = rng.randint(1, 6)
    try:
        async with asyncio.timeout(limit):
            async with http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    assert r.status_code in DOCUMENTED, (r.status_code, text[:300])
                    seen[f"status {r.status_code}"] += 1
                    return
                lines = 0
                async for _ in r.aiter_lines():
                    lines += 1
                    if kind == "cut" and lines >= cut_at:
                        seen["cut mid-stream"] += 1
                        return  # leaving the block closes the connection
        seen["finished"] += 1
    except TimeoutError:
        assert kind.startswith("give_up"), f"a {kind} request took over {REQUEST_CAP_S} s"
        seen["gave up"] += 1


async def churn(url: str, seconds: float, give_up_s: float, seed: int) -> Counter[str]:
    """CLIENTS clients, each sending request after request until `seconds` have passed."""
    seen: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=CLIENTS * 2, max_keepalive_connections=CLIENTS)

    async def client(http: httpx.AsyncClient, rng: random.Random) -> None:
        while time.monotonic() < deadline:
            await _one(http, rng, give_up_s, seen)

    master = random.Random(seed)
    # One pool of connections for them all (a client each would spend seconds making its TLS
    # context first); a request that gives up closes its own connection.
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_CAP_S, limits=limits) as http:
        await asyncio.gather(*(client(http, random.Random(master.random()))
                               for _ in range(CLIENTS)))
    return seen


def held(server: Server) -> tuple[int, int]:
    """(leases on every engine, queue slots running or waiting) as /status reports them."""
    status = httpx.get(server.url + "/status", headers=server.admin_headers, timeout=10).json()
    leases = sum(m.get("leases", 0) for e in status["engines"] for m in e.get("models", []))
    queued = sum(q["running"] + q["queued"] for q in status["queues"].values())
    return leases, queued


def settled(server: Server, timeout_s: float) -> tuple[int, int]:
    """What is held once the requests the clients left have ended (bounded: a request whose
    client left is finished within a stream's remaining tokens); (0, 0) when nothing is."""
    deadline = time.monotonic() + timeout_s
    while (found := held(server)) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def unload(server: Server, timeout_s: float) -> dict[str, Any]:
    """POST /admin/models/<model>/unload; it waits for the model's leases, so a leaked one hangs
    it: bounded by `timeout_s` (httpx raises)."""
    r = httpx.post(f"{server.url}/admin/models/{MODEL}/unload", headers=server.admin_headers,
                   timeout=timeout_s)
    assert r.status_code == 200, r.text
    return dict(r.json())


def churn_round(server: Server, seconds: float, give_up_s: float, seed: int) -> Counter[str]:
    """One round from a cold model: churn, then nothing held, then the model unloads."""
    seen = asyncio.run(churn(server.url, seconds, give_up_s, seed))
    assert settled(server, timeout_s=30) == (0, 0), (held(server), dict(seen))
    assert unload(server, timeout_s=30)["status"] == "unloaded", dict(seen)
    return seen
