"""Models bigger than one GPU, on simulated 2x24 GiB devices owned by one engine (the default
`engine_devices: per_node`): fake backends claim per device as their placement says, so every
figure checked here is what live processes hold on each device (hw/simulated.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.harness import HELLO, config, model_status, module_server, status
from tests.support import Server, fake_model

from modelyard.hw.simulated import SimulatedGpu

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

GIB = 2**30


def sim(model_id: str, gib: int, **fields: Any) -> dict[str, Any]:
    """A fake that claims `gib` over the devices of its placement."""
    nbytes = gib * GIB
    return fake_model(model_id, "--claim-bytes", str(nbytes), vram_bytes=nbytes, **fields)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = config(
        sim("small10", 10), sim("big40", 40), sim("big30", 30),
        sim("huge52", 52, offload="auto"), sim("nope52", 52),
        simulate_gpus="2x24GiB", keep_alive_s=-1, memory_recovery_timeout_s=10,
    )
    with module_server(tmp_path_factory, cfg) as s:
        yield s


def chat(server: Server, model: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions",
                      json={"model": model, "messages": HELLO, "max_tokens": 3}, timeout=60)


def claims(server: Server, pid: int) -> list[int]:
    """What `pid` holds on simulated device 0 and 1 now."""
    return [SimulatedGpu(i, 24 * GIB, server.home / "run" / "simgpu" / str(i))
            .used_by_pid().get(pid, 0) for i in (0, 1)]


def placed(server: Server, model: str) -> dict[str, Any]:
    m = model_status(server, model)
    assert m is not None and m["state"] == "ready", m
    assert m["placement"] is not None, m
    return dict(m)


def test_one_engine_owns_both_devices(server: Server) -> None:
    engines = status(server)["engines"]
    assert len(engines) == 1
    devices = engines[0]["devices"]
    assert [(d["index"], d["total_bytes"]) for d in devices] == [(0, 24 * GIB), (1, 24 * GIB)]
    assert engines[0]["device"]["total_bytes"] == 48 * GIB  # the group's sum


def test_a_model_that_fits_one_device_takes_one(server: Server) -> None:
    assert chat(server, "small10").status_code == 200
    m = placed(server, "small10")
    assert len(m["placement"]["devices"]) == 1
    assert sorted(claims(server, m["pid"])) == [0, 10 * GIB]


def test_a_model_bigger_than_one_device_spans_both_and_answers(server: Server) -> None:
    r = chat(server, "big40")
    assert r.status_code == 200, r.text
    m = placed(server, "big40")
    assert m["placement"]["label"] == "gpu0+gpu1"
    held = claims(server, m["pid"])
    assert all(n > 0 for n in held) and sum(held) == 40 * GIB
    # Measured per device replaces the estimate; each device reports what it holds.
    assert [d["bytes"] for d in m["placement"]["devices"]] == held
    devices = status(server)["engines"][0]["devices"]
    assert all(d["used_bytes"] >= n for d, n in zip(devices, held, strict=True))
    assert model_status(server, "small10")["state"] != "ready"  # type: ignore[index]


def test_a_spanning_victim_frees_both_devices(server: Server) -> None:
    if (m := model_status(server, "big40")) is None or m["state"] != "ready":
        assert chat(server, "big40").status_code == 200
    victim = placed(server, "big40")["pid"]
    assert chat(server, "big30").status_code == 200
    assert claims(server, victim) == [0, 0]  # its process is gone from both devices
    m = placed(server, "big30")
    assert m["placement"]["label"] == "gpu0+gpu1"
    assert sum(claims(server, m["pid"])) == 30 * GIB
    swaps = status(server)["engines"][0]["scheduler"]["recent_swaps"]
    assert any(s["unloaded"] == "big40" and s["reason"] == "for big30" for s in swaps)


def test_offload_auto_keeps_the_rest_in_host_ram(server: Server) -> None:
    r = chat(server, "huge52")
    assert r.status_code == 200, r.text
    m = placed(server, "huge52")
    p = m["placement"]
    assert p["host_bytes"] > 0 and p["split"].endswith("CPU/GPU")
    assert sum(claims(server, m["pid"])) == 52 * GIB - p["host_bytes"]
    ps = httpx.get(server.url + "/api/ps", timeout=10).json()["models"]
    row = next(x for x in ps if x["name"].startswith("huge52"))
    assert 0 < row["size_vram"] < row["size"]
    assert row["size"] - row["size_vram"] == p["host_bytes"]


def test_offload_off_is_a_clear_503(server: Server) -> None:
    r = chat(server, "nope52")
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "insufficient_memory"
    assert "nope52" in err["message"] and "GiB" in err["message"]


def test_ps_shows_the_placement_and_split(server: Server, tmp_path: Path) -> None:
    if (m := model_status(server, "huge52")) is None or m["state"] != "ready":
        assert chat(server, "huge52").status_code == 200
    r = httpx.get(server.url + "/v1/status", headers=server.admin_headers, timeout=10)
    assert r.status_code == 200, r.text
    row = next(x for e in r.json()["engines"] for x in e["models"] if x["model"] == "huge52")
    assert row["placement"] == "gpu0+gpu1"
    assert row["processor"].endswith("CPU/GPU") and "%/" in row["processor"]
