"""Scheduling on a simulated GPU: models on demand, eviction, waiting, queues, keep-alive.

Every model is a real fake llama-server process that claims its memory on the simulated device
(`--claim-bytes`), so the device's free memory is what live processes really hold, and a
background sampler checks that the claims of live processes never exceed the device.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.harness import (
    HELLO,
    TEXT_16,
    config,
    model_status,
    pid_alive,
    starts,
    status,
)
from tests.support import Server, fake_model, poll

from modelyard.hw.simulated import SimulatedGpu

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

GIB = 2**30
DEVICE = 8 * GIB


def sim_model(model_id: str, gib: float, files: Path, *flags: str, **fields: Any) -> dict[str, Any]:
    """A fake model that holds `gib` on the simulated GPU and logs its starts."""
    nbytes = int(gib * GIB)
    return fake_model(
        model_id, "--claim-bytes", str(nbytes), "--start-log", str(files / f"{model_id}.starts"),
        *flags, vram_bytes=nbytes, **fields,
    )


def sim_config(*models: dict[str, Any], **settings: Any) -> dict[str, Any]:
    return config(*models, simulate_gpus="1x8GiB", **settings)


class ClaimSampler:
    """Samples the simulated device's live claims in a thread; remembers the peak."""

    def __init__(self, home: Path) -> None:
        self.gpu = SimulatedGpu(0, DEVICE, home / "run" / "simgpu" / "0")
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, sum(self.gpu.used_by_pid().values()))

    def __enter__(self) -> ClaimSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def serving(tmp_path: Path, cfg: dict[str, Any]) -> Iterator[Server]:
    server = Server(tmp_path / "front", cfg)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def scheduler_stats(server: Server) -> dict[str, Any]:
    return dict(status(server)["engines"][0]["scheduler"])


def chat(url: str, model: str, **body: Any) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions", json={"model": model, "messages": HELLO, **body}, timeout=60
    )


async def stream_text(client: httpx.AsyncClient, model: str) -> str:
    """The text of a streamed OpenAI chat; raises on an error status or an in-band error."""
    body = {"model": model, "messages": HELLO, "stream": True}
    text = ""
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise AssertionError(f"{model}: {r.status_code} {r.text}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            assert "error" not in event, event
            for choice in event["choices"]:
                text += choice["delta"].get("content") or ""
    return text


def test_three_models_memory_for_two_mixed_load_fails_nothing(
    tmp_path: Path, files: Path
) -> None:
    models = [sim_model(m, 3.5, files, "--tokens-per-s", "80") for m in ("a", "b", "c")]
    with serving(tmp_path, sim_config(*models)) as server, ClaimSampler(server.home) as sampler:

        async def run() -> list[str]:
            limits = httpx.Limits(max_connections=20)
            async with httpx.AsyncClient(
                base_url=server.url, timeout=60, limits=limits
            ) as client:
                order = ["a", "b", "c", "a", "c", "b"] * 4
                return await asyncio.gather(*(stream_text(client, m) for m in order))

        texts = asyncio.run(run())
        assert texts == [TEXT_16] * 24  # no request failed, none was cut by an eviction
        stats = scheduler_stats(server)
        assert stats["evictions"] >= 1, stats
        assert stats["load_failures"] == 0 and stats["no_fit"] == 0
        assert all(s["reason"].startswith("for ") for s in stats["recent_swaps"])
    assert 0 < sampler.peak <= DEVICE, f"device over-committed: {sampler.peak / GIB:.1f} GiB"


def test_a_load_waits_for_a_busy_model_then_evicts_it(tmp_path: Path, files: Path) -> None:
    slow = sim_model("slow", 5, files, "--tokens-per-s", "20")  # 16 tokens: about 0.8 s
    other = sim_model("other", 5, files)
    with serving(tmp_path, sim_config(slow, other)) as server, ClaimSampler(server.home) as s:

        async def run() -> tuple[str, str]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                first = asyncio.create_task(stream_text(client, "slow"))
                await asyncio.to_thread(
                    poll, lambda: (model_status(server, "slow") or {}).get("leases") == 1,
                    10, "slow to be busy",
                )
                second = await stream_text(client, "other")
                return await first, second

        first, second = asyncio.run(run())
        assert first == second == TEXT_16
        stats = scheduler_stats(server)
        assert stats["waits"] == 1 and stats["evictions"] == 1
        assert model_status(server, "slow")["state"] == "stopped"
    assert s.peak <= DEVICE


def test_an_eviction_while_another_model_loads_waits_only_for_its_own_memory(
    tmp_path: Path, files: Path
) -> None:
    """`c` is loading and has not claimed its memory yet when `b` is evicted for `a`: the wait for
    b's memory must not count c's coming claim as memory to get back (it used to wait out
    `memory_recovery_timeout_s`, then warn "memory not back")."""
    # b takes a while to go (it ignores SIGTERM): c fills the device meanwhile.
    a, b = sim_model("a", 3, files), sim_model("b", 3, files, "--ignore-sigterm")
    c = sim_model("c", 3, files, "--claim-after-s", "1.0", "--load-time-s", "3")
    cfg = sim_config(a, b, c, memory_recovery_timeout_s=30, stop_grace_s=1.0)
    with serving(tmp_path, cfg) as server, ClaimSampler(server.home) as sampler:
        assert chat(server.url, "a").status_code == 200
        assert chat(server.url, "b").status_code == 200

        async def run() -> tuple[str, str]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                for_c = asyncio.create_task(stream_text(client, "c"))  # evicts a, then loads

                def c_has_begun_claiming() -> bool:  # its first MiB: nobody else holds that
                    return 2**20 in sampler.gpu.used_by_pid().values()

                await asyncio.to_thread(poll, c_has_begun_claiming, 10, "c to begin its claim")
                again_a = await stream_text(client, "a")  # evicts b while c loads
                return await for_c, again_a

        assert asyncio.run(run()) == (TEXT_16, TEXT_16)
        engine_log = (server.home / "logs" / "engine-0.log").read_text()
        assert "memory not back" not in engine_log
        assert "unloading b (for a)" in engine_log
    assert sampler.peak <= DEVICE


def test_a_model_bigger_than_the_device_is_503_insufficient_memory(
    tmp_path: Path, files: Path
) -> None:
    with serving(tmp_path, sim_config(sim_model("huge", 10, files))) as server:
        r = chat(server.url, "huge")
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["code"] == "insufficient_memory"
        assert "10.0 GiB" in err["message"] and "8.0 GiB" in err["message"]
        assert starts(files / "huge.starts") == []  # never even started


def test_pinned_and_coexisting_models_are_never_evicted(tmp_path: Path, files: Path) -> None:
    pinned = sim_model("pinned", 2, files, pinned=True)
    q = sim_model("q", 2, files)
    r = sim_model("r", 2.5, files, can_coexist_with=["q"])
    z = sim_model("z", 2.5, files)
    with serving(tmp_path, sim_config(pinned, q, r, z)) as server:
        for model in ("pinned", "q", "z"):
            assert chat(server.url, model).status_code == 200
        pinned_pid = model_status(server, "pinned")["pid"]
        q_pid = model_status(server, "q")["pid"]
        # r needs 2.5 GiB with 1.5 free. q is the least recently used, but it may coexist
        # with r, and pinned is pinned: z must go.
        assert chat(server.url, "r").status_code == 200
        assert model_status(server, "q")["pid"] == q_pid
        assert model_status(server, "z")["state"] == "stopped"
        # Then z and r swap each other out; pinned stays through it all.
        for model in ("z", "r", "z", "r"):
            assert chat(server.url, model).status_code == 200
        assert model_status(server, "pinned")["pid"] == pinned_pid
        assert len(starts(files / "pinned.starts")) == 1
        unloaded = [s["unloaded"] for s in scheduler_stats(server)["recent_swaps"]]
        assert unloaded[0] == "z" and "pinned" not in unloaded, unloaded


def test_groups_swap_each_other_out_exclusively(tmp_path: Path, files: Path) -> None:
    a1 = sim_model("a1", 1, files, group="A")
    a2 = sim_model("a2", 1, files, group="A")
    b1 = sim_model("b1", 1, files, group="B")
    with serving(tmp_path, sim_config(a1, a2, b1)) as server:
        for model in ("a1", "a2"):
            assert chat(server.url, model).status_code == 200
        assert model_status(server, "a1")["state"] == "ready"  # same group cohabits
        assert chat(server.url, "b1").status_code == 200  # memory is plenty, yet A goes
        assert model_status(server, "a1")["state"] == "stopped"
        assert model_status(server, "a2")["state"] == "stopped"


def test_queue_overflow_is_429_with_retry_after(tmp_path: Path, files: Path) -> None:
    slow = sim_model("slow", 1, files, "--tokens-per-s", "10", max_concurrency=1, max_queue=1)
    with serving(tmp_path, sim_config(slow)) as server:
        assert chat(server.url, "slow", max_tokens=1).status_code == 200  # loaded

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                body = {"model": "slow", "messages": HELLO, "max_tokens": 10}
                running = asyncio.create_task(client.post("/v1/chat/completions", json=body))
                await asyncio.to_thread(
                    poll, lambda: model_status(server, "slow")["leases"] == 1, 10, "a lease"
                )
                queued = asyncio.create_task(client.post("/v1/chat/completions", json=body))
                await asyncio.to_thread(
                    poll, lambda: status(server)["queues"]["slow"]["queued"] == 1, 10, "a waiter"
                )
                refused = await client.post("/v1/chat/completions", json=body)
                ollama = await client.post("/api/chat", json={**body, "stream": False})
                return [await running, await queued, refused, ollama]

        running, queued, refused, ollama = asyncio.run(run())
        assert running.status_code == queued.status_code == 200
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "queue_full"
        assert int(refused.headers["retry-after"]) >= 1
        assert ollama.status_code == 429 and "retry-after" in ollama.headers
        queues = status(server)["queues"]["slow"]
        assert queues["rejected_total"] == 2 and queues["running"] == 0


def test_requests_dropped_right_after_the_grant_leak_nothing(
    tmp_path: Path, files: Path
) -> None:
    m = sim_model("m", 1, files, "--tokens-per-s", "50", max_concurrency=2)
    with serving(tmp_path, sim_config(m)) as server:

        async def run() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                body = {"model": "m", "messages": HELLO, "stream": True}
                for _ in range(10):  # the first one also waits for the load
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        assert r.status_code == 200
                    # … and the client is gone right after the grant and the headers.
                tasks = [asyncio.create_task(client.post("/v1/chat/completions", json=body))
                         for _ in range(6)]
                await asyncio.sleep(0)  # let them be sent, then drop them mid-queue
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(run())
        poll(lambda: model_status(server, "m")["leases"] == 0, 10, "every lease back")
        poll(lambda: status(server)["queues"]["m"]["running"] == 0, 10, "every slot back")
        assert status(server)["queues"]["m"]["queued"] == 0
        assert chat(server.url, "m").status_code == 200  # and the model still serves


def test_keep_alive_expiry_ollama_zero_and_forever(tmp_path: Path, files: Path) -> None:
    short = sim_model("short", 1, files, keep_alive_s=0.5)
    forever = sim_model("forever", 1, files)
    with serving(tmp_path, sim_config(short, forever)) as server:
        assert chat(server.url, "short").status_code == 200
        poll(lambda: model_status(server, "short")["state"] == "stopped", 10, "idle unload")
        # Ollama: keep_alive -1 keeps it forever, 0 unloads once the request is done.
        body = {"model": "forever", "messages": HELLO, "stream": False, "keep_alive": -1}
        assert httpx.post(server.url + "/api/chat", json=body, timeout=30).status_code == 200
        assert model_status(server, "forever")["keep_alive_s"] is None
        body["keep_alive"] = 0
        assert httpx.post(server.url + "/api/chat", json=body, timeout=30).status_code == 200
        poll(lambda: model_status(server, "forever")["state"] == "stopped", 10, "unload")
        # An empty Ollama chat loads; with keep_alive 0 it unloads.
        r = httpx.post(server.url + "/api/generate", json={"model": "forever"}, timeout=30)
        assert r.json()["done_reason"] == "load"
        assert model_status(server, "forever")["state"] == "ready"
        r = httpx.post(server.url + "/api/generate", json={"model": "forever", "keep_alive": 0},
                       timeout=30)
        assert r.json()["done_reason"] == "unload"
        assert model_status(server, "forever")["state"] == "stopped"
        r = httpx.post(server.url + "/api/generate", json={"model": "forever",
                                                           "keep_alive": "soon"}, timeout=30)
        assert r.status_code == 400 and "keep_alive" in r.json()["error"]
        assert scheduler_stats(server)["expirations"] >= 1


def test_unload_waits_until_the_memory_is_really_back(tmp_path: Path, files: Path) -> None:
    # It ignores SIGTERM: its memory comes back only after the grace and the KILL.
    stubborn = sim_model("stubborn", 5, files, "--ignore-sigterm")
    other = sim_model("other", 5, files)
    cfg = sim_config(stubborn, other, stop_grace_s=1.0)
    with serving(tmp_path, cfg) as server, ClaimSampler(server.home) as sampler:
        assert chat(server.url, "stubborn").status_code == 200
        stubborn_pid = model_status(server, "stubborn")["pid"]
        assert chat(server.url, "other").status_code == 200
        assert not pid_alive(stubborn_pid)
    assert sampler.peak <= DEVICE, f"loaded before the memory was back: {sampler.peak / GIB} GiB"


def test_admin_load_unload_engines_and_the_cli(tmp_path: Path, files: Path) -> None:
    x = sim_model("x", 3, files)
    y = sim_model("y", 3, files)
    with serving(tmp_path, sim_config(x, y, startup_models=["x"])) as server:
        assert model_status(server, "x")["state"] == "ready"  # before /health said healthy

        def cli(*args: str) -> str:
            out = subprocess.run(
                [sys.executable, "-m", "modelyard", *args, "--url", server.url],
                capture_output=True, text=True, timeout=60, check=True,
                # rich wraps tables to the terminal; the server's home has the CLI's token
                env={**os.environ, "COLUMNS": "200", "MODELYARD_HOME": str(server.home)},
            )
            return out.stdout

        assert "y loaded on engine-0" in cli("load", "y")
        assert model_status(server, "y")["state"] == "ready"
        ps = cli("ps")
        assert "simulated GPU 0" in ps and "x" in ps and "y" in ps
        assert "y unloaded from engine-0" in cli("unload", "y")
        assert model_status(server, "y")["state"] == "stopped"
        assert "was not loaded" in cli("unload", "y")
        engines = httpx.get(server.url + "/admin/engines", headers=server.admin_headers,
                            timeout=10).json()["engines"]
        assert engines[0]["device"]["total_bytes"] == DEVICE
        assert engines[0]["scheduler"]["unloads"] == 1
        r = httpx.post(server.url + "/admin/models/nope/load", headers=server.admin_headers,
                       timeout=10)
        assert r.status_code == 404 and r.json()["error"] == "model_not_found"


def test_a_hot_cpu_pauses_new_work_until_it_cools(tmp_path: Path, files: Path) -> None:
    sensors = tmp_path / "sensors.json"
    sensors.write_text('{"cpu": 95}')
    thermal = {"poll_s": 0.05, "simulated_sensors_file": str(sensors)}
    with serving(tmp_path, sim_config(sim_model("t", 1, files), thermal=thermal)) as server:
        poll(lambda: status(server)["engines"][0]["paused"], 10, "the engine to pause")
        assert "cpu at 95" in status(server)["engines"][0]["paused"]

        async def run() -> httpx.Response:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                waiting = asyncio.create_task(
                    client.post("/v1/chat/completions", json={"model": "t", "messages": HELLO})
                )
                await asyncio.sleep(0.3)  # paused: it must not be served meanwhile
                assert not waiting.done()
                assert starts(files / "t.starts") == []
                sensors.write_text('{"cpu": 60}')
                return await waiting

        assert asyncio.run(run()).status_code == 200
        assert status(server)["engines"][0]["paused"] is None
        assert scheduler_stats(server)["thermal_pauses"] == 1


def test_a_client_that_leaves_the_queue_is_dropped_at_once(tmp_path: Path, files: Path) -> None:
    slow = sim_model("slow", 1, files, "--tokens-per-s", "10", max_concurrency=1)
    with serving(tmp_path, sim_config(slow)) as server:
        assert chat(server.url, "slow", max_tokens=1).status_code == 200  # loaded
        upstream = model_status(server, "slow")["upstream"]

        async def run() -> httpx.Response:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                body = {"model": "slow", "messages": HELLO, "max_tokens": 20}  # about 2 s
                running = asyncio.create_task(client.post("/v1/chat/completions", json=body))
                await asyncio.to_thread(
                    poll, lambda: model_status(server, "slow")["leases"] == 1, 10, "a lease"
                )
                leaving = asyncio.create_task(client.post("/api/chat", json=body))
                await asyncio.to_thread(
                    poll, lambda: status(server)["queues"]["slow"]["queued"] == 1, 10, "a waiter"
                )
                leaving.cancel()  # the client goes away while queued
                queues = await asyncio.to_thread(
                    poll, lambda: (q := status(server)["queues"]["slow"])["queued"] == 0 and q,
                    10, "the waiter to leave",
                )
                assert not running.done(), "it left only when the slot came free"
                assert queues["cancelled_total"] == 1
                return await running

        assert asyncio.run(run()).status_code == 200
        stats = httpx.get(upstream + "/stats", timeout=10).json()
        assert stats["requests_started"] == 2  # the warm-up and the one that stayed


def test_two_gpus_a_cold_model_goes_where_nothing_must_be_evicted(
    tmp_path: Path, files: Path
) -> None:
    a = sim_model("a", 5, files)
    b = sim_model("b", 5, files)
    p = sim_model("p", 2, files, engine=1)
    cfg = config(a, b, p, simulate_gpus="2x8GiB", engine_devices="per_gpu")
    with serving(tmp_path, cfg) as server:
        for model in ("a", "b", "p", "a", "b"):
            assert chat(server.url, model).status_code == 200
        engines = status(server)["engines"]
        assert [e["device"]["name"] for e in engines] == ["simulated GPU 0", "simulated GPU 1"]
        held = {e["name"]: {m["model"] for m in e["models"] if m["state"] == "ready"}
                for e in engines}
        a_engine = next(name for name, models in held.items() if "a" in models)
        b_engine = next(name for name, models in held.items() if "b" in models)
        assert a_engine != b_engine  # b went where a did not have to be evicted
        assert "p" in held["engine-1"]  # pinned to engine 1
        assert sum(e["scheduler"]["evictions"] for e in engines) == 0
        assert [e["device"]["used_bytes"] for e in engines] == [
            sum(int(g * GIB) for m, g in (("a", 5), ("b", 5), ("p", 2)) if m in held[e["name"]])
            for e in engines
        ]


def sse_events(text: str) -> list[Any]:
    return [json.loads(line[5:]) for line in text.splitlines()
            if line.startswith("data:") and line.strip() != "data: [DONE]"]


def test_swap_progress_streams_as_reasoning_before_the_first_token(
    tmp_path: Path, files: Path
) -> None:
    a = sim_model("a", 5, files)
    b = sim_model("b", 5, files, "--load-time-s", "0.3")
    bad = sim_model("bad", 1, files, "--crash-on-load")
    cfg = sim_config(a, b, bad, notify_model_swap=True)
    with serving(tmp_path, cfg) as server:
        assert chat(server.url, "a").status_code == 200
        body = {"model": "b", "messages": HELLO, "stream": True}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200
        events = sse_events(r.text)
        reasoning = [e["choices"][0]["delta"].get("reasoning_content") for e in events]
        progress = "".join(x for x in reasoning if x)
        assert progress.startswith("unloading a to make room for b\nloading b (5.0 GiB)\nb ready")
        content = [e["choices"][0]["delta"].get("content") for e in events]
        assert all(reasoning[:3]) and not any(content[:3])  # progress before the first token
        assert "".join(c or "" for c in content) == TEXT_16

        # Ready model: no progress at all. Ollama: progress as `thinking`.
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert "reasoning_content" not in r.text
        ollama = {"model": "a", "messages": HELLO, "stream": True}
        lines = [json.loads(x) for x in httpx.post(
            server.url + "/api/chat", json=ollama, timeout=30).text.splitlines()]
        assert lines[0]["message"]["thinking"] == "unloading b to make room for a\n"
        assert "".join(x["message"]["content"] for x in lines) == TEXT_16
        assert lines[-1]["done"] is True

        # A load that fails after progress began: an in-band error, then the end.
        r = httpx.post(server.url + "/chat", json={**body, "model": "bad"}, timeout=30)
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[0]["delta"]["reasoning_content"].startswith("loading bad")
        assert events[-1]["error"] == "model_load_failed"


def test_engine_specs_decide_which_engine_may_run_a_model(tmp_path: Path, files: Path) -> None:
    vision = sim_model("vision", 1, files, requires=["vision"])
    plain = sim_model("plain", 1, files, engine=0)
    specs = {1: {"capabilities": ["vision"]}, 0: {"backends": ["llamacpp"]}}
    cfg = config(vision, plain, simulate_gpus="2x8GiB", engine_devices="per_gpu",
                 engine_specs=specs)
    with serving(tmp_path, cfg) as server:
        assert chat(server.url, "vision").status_code == 200
        engines = status(server)["engines"]
        assert [m["model"] for m in engines[1]["models"]] == ["vision"]
        # plain is pinned to engine 0, which runs only llama.cpp models: nowhere to go.
        r = chat(server.url, "plain")
        assert r.status_code == 503
        assert "engine-0" in r.json()["error"]["message"]


@contextlib.asynccontextmanager
async def busy(client: httpx.AsyncClient, server: Server, model: str) -> AsyncIterator[None]:
    """A stream on `model` that holds its lease until the block ends (then the client leaves)."""
    body = {"model": model, "messages": HELLO, "stream": True, "max_tokens": 100_000}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.aiter_lines()
        await anext(lines)  # the first chunk: the lease is held
        yield
    await asyncio.to_thread(
        poll, lambda: model_status(server, model)["leases"] == 0, 10, f"{model}'s lease back")


def waiting_for_memory(server: Server, model: str) -> bool:
    return (model_status(server, model) or {}).get("waiting_for_memory_s") is not None


def test_a_load_whose_client_left_evicts_nothing(tmp_path: Path, files: Path) -> None:
    # (model ids of its own: the start logs in `files` are shared by the module)
    a = sim_model("held", 1, files, "--tokens-per-s", "20")
    cfg = sim_config(a, sim_model("left", 1, files), max_loaded_models=1)
    with serving(tmp_path, cfg) as server:
        engine_log = server.home / "logs" / "engine-0.log"

        async def run() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client, \
                    busy(client, server, "held"):
                with pytest.raises(httpx.ReadTimeout):  # it waits for `a`: gives up after 1 s
                    await client.post("/v1/chat/completions", timeout=1,
                                      json={"model": "left", "messages": HELLO})
                await asyncio.to_thread(
                    poll, lambda: "nobody waits for left any more" in engine_log.read_text(),
                    10, "left's load to be dropped")
            # held's request has ended (busy waits for its lease): nothing may go for `left`.

        asyncio.run(run())
        assert starts(files / "left.starts") == []
        assert model_status(server, "held")["state"] == "ready"
        assert len(starts(files / "held.starts")) == 1
        assert scheduler_stats(server)["evictions"] == 0
        assert chat(server.url, "left").status_code == 200  # asked again, it loads


def test_loads_waiting_for_memory_are_placed_in_arrival_order(tmp_path: Path, files: Path) -> None:
    models = [sim_model(m, 1, files, "--tokens-per-s", "20") for m in ("a", "b", "c")]
    with serving(tmp_path, sim_config(*models, max_loaded_models=1)) as server:

        async def run() -> tuple[str, str]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                async with busy(client, server, "a"):
                    for_b = asyncio.create_task(stream_text(client, "b"))
                    await asyncio.to_thread(poll, lambda: waiting_for_memory(server, "b"), 10,
                                            "b to wait for a")
                    for_c = asyncio.create_task(stream_text(client, "c"))
                    await asyncio.to_thread(poll, lambda: waiting_for_memory(server, "c"), 10,
                                            "c to wait")
                return await for_b, await for_c

        assert asyncio.run(run()) == (TEXT_16, TEXT_16)
        swaps = [(s["unloaded"], s["reason"]) for s in scheduler_stats(server)["recent_swaps"]]
        assert swaps == [("a", "for b"), ("b", "for c")]  # b first: it came first
