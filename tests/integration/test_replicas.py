"""Replicas of a hot model (issue 19 point 5) on two simulated 24 GiB GPUs.

Every copy is a real fake llama-server process claiming its memory on the simulated device, so
where a copy runs is what the engines report in /status (which engine, which device), and how
much each copy serves is what its engine counts (`leases`, `last_used`), not the front's word.
The tests hold whether the two GPUs are two engines (today) or one engine with two devices
(`engine_devices: per_node`): a copy's place is its placement's devices, else its engine's.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tests.integration.harness import HELLO, TEXT_16, config, module_server, status
from tests.support import Server, fake_model, poll

from modelyard.front.dispatch.replicas import home_copy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

GIB = 2**30


def _model(model_id: str, tokens_per_s: int = 40, **fields: Any) -> dict[str, Any]:
    # 16 tokens at 40/s: a request holds its copy for about 0.4 s
    return fake_model(model_id, "--claim-bytes", str(4 * GIB), "--tokens-per-s",
                      str(tokens_per_s), vram_bytes=4 * GIB, **fields)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = config(
        _model("hot", replicas=2),
        _model("surge", tokens_per_s=20, max_replicas=2, max_concurrency=1),
        simulate_gpus="2x24GiB", replica_scale_up_wait_s=0.5, replica_idle_s=2.0,
    )
    with module_server(tmp_path_factory, cfg) as s:
        yield s


def copies(server: Server) -> dict[str, dict[str, Any]]:
    """Every model the engines hold, by name: its state, leases, last use and place."""
    out = {}
    for engine in status(server)["engines"]:
        for m in engine["models"]:
            placement = m.get("placement")
            place = ((engine["name"], *(d["index"] for d in placement["devices"])) if placement
                     else (engine["name"], engine["device"]["name"]))
            out[m["model"]] = {**m, "place": place, "engine_name": engine["name"]}
    return out


async def _ask(client: httpx.AsyncClient, model: str, **body: Any) -> str:
    r = await client.post("/v1/chat/completions",
                          json={"model": model, "messages": HELLO, **body})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["model"] == model  # a copy answers as the model asked for
    return str(answer["choices"][0]["message"]["content"])


class LeaseSampler:
    """Samples the engines' /status in a thread: the copies seen serving (leases > 0), and
    each model as last seen ready."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.serving: set[str] = set()
        self.ready: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            held = copies(self.server)
            self.serving |= {name for name, m in held.items() if m["leases"]}
            self.ready |= {name: m for name, m in held.items() if m["state"] == "ready"}

    def __enter__(self) -> LeaseSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_replicas_are_loaded_at_start_on_different_devices_and_share_the_load(
    server: Server,
) -> None:
    held = copies(server)
    assert held["hot"]["state"] == held["hot#2"]["state"] == "ready"  # loaded at boot
    assert held["hot"]["pinned"] and held["hot#2"]["pinned"]
    assert held["hot"]["place"] != held["hot#2"]["place"]

    async def burst() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(_ask(client, "hot") for _ in range(20)))

    with LeaseSampler(server) as sampler:
        answers = asyncio.run(burst())
    assert answers == [TEXT_16] * 20
    assert {"hot", "hot#2"} <= sampler.serving  # both copies served some of the 20

    # copies are never listed, but /api/ps and /status show each one
    listed = {m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]}
    tags = {m["name"] for m in httpx.get(server.url + "/api/tags").json()["models"]}
    assert "hot" in listed and not any("#" in name for name in listed | tags)
    ps = [m["name"] for m in httpx.get(server.url + "/api/ps").json()["models"]]
    assert sorted(n for n in ps if n.startswith("hot")) == ["hot#2:latest", "hot:latest"]
    front = status(server)["replicas"]["hot"]
    assert [c["model"] for c in front["copies"]] == ["hot", "hot#2"]


def test_a_chat_session_stays_on_its_copy(server: Server) -> None:
    """A session starts on its home copy (a function of its id, so every front picks the
    same one) and stays there, though an ordinary request would go to the first copy."""
    sid = next(s for s in (f"s-sticky-{i}" for i in range(100))
               if home_copy(s, ["hot", "hot#2"], pinned=2) == "hot#2")

    async def turns() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            for _ in range(2):  # both copies idle each time
                before = copies(server)
                await _ask(client, "hot", session_id=sid)
                after = copies(server)
                assert after["hot#2"]["last_used"] > before["hot#2"]["last_used"]
                assert after["hot"]["last_used"] == before["hot"]["last_used"]

    asyncio.run(turns())


def test_a_queue_that_waits_adds_a_copy_which_goes_when_idle(server: Server) -> None:
    assert "surge#2" not in copies(server)

    async def burst(n: int) -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(_ask(client, "surge") for _ in range(n)))

    with LeaseSampler(server) as sampler:
        # One at a time (max_concurrency 1), 0.8 s each: the queue waits past 0.5 s, a second
        # copy loads, and requests still waiting move to it.
        assert asyncio.run(burst(10)) == [TEXT_16] * 10  # none lost
    assert {"surge", "surge#2"} <= sampler.serving  # the copy served part of the same burst
    extra, first = sampler.ready["surge#2"], sampler.ready["surge"]
    assert extra["place"] != first["place"] and not extra["pinned"]
    # idle for replica_idle_s (2 s): the extra copy unloads; the model itself stays
    poll(lambda: copies(server).get("surge#2", {}).get("state") != "ready",
         what="the extra copy unloaded")
    assert copies(server)["surge"]["state"] == "ready"
    assert [c["model"] for c in status(server)["replicas"]["surge"]["copies"]] == ["surge"]
