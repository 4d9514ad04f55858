"""GET /v1/status's shape, from a canned front status (two engines, one down)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from modelyard.cli.status import render
from modelyard.front.ops.overview import overview

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

STATUS = json.loads((Path(__file__).parent.parent / "data" / "status" / "two_engines.json")
                    .read_text())
PULL = {"id": "j1", "model": "org/x-GGUF", "status": "running", "bytes_done": 50,
        "bytes_total": 100, "current_file": "x.gguf"}


def test_summary_devices_engines_services_and_scheduler() -> None:
    view = overview(STATUS, [PULL])
    assert view["summary"] == {"engines": 2, "engines_up": 1, "models_loaded": 1,
                               "requests_running": 2, "requests_queued": 3, "pulls_active": 1,
                               "cooling": []}
    (device,) = view["devices"]
    assert device["engine"] == "engine-0" and device["used_fraction"] == 0.75
    assert device["holds"] == [{"model": "b", "bytes": 5500000000},
                               {"model": "tts", "bytes": 500000000}]
    up, down = view["engines"]
    assert [m["model"] for m in up["models"]] == ["b"]  # stopped and services left out
    assert up["models"][0]["memory_bytes"] == 5500000000  # measured wins over reserved
    assert down == {"name": "engine-1", "up": False, "pid": None,
                    "error": "engine-1 is restarting", "cooling": None, "gpu_warning": None,
                    "models": []}
    assert view["services"] == [{"model": "tts", "engine": "engine-0", "state": "ready",
                                 "healthy": True, "url": "http://127.0.0.1:9000",
                                 "in_flight": 1, "memory_bytes": 500000000}]
    assert view["scheduler"]["loads"] == 3 and view["scheduler"]["waits"] == 2
    assert view["scheduler"]["recent_swaps"] == [
        {"at": 1000.0, "unloaded": "a", "reason": "for b", "bytes": 4000,
         "engine": "engine-0"}]
    assert view["pulls"][0]["bytes_done"] == 50


def test_ps_renders_every_part() -> None:
    console = Console(width=200, record=True)
    console.print(render(overview(STATUS, [PULL])))
    text = console.export_text()
    for expected in ("simulated GPU 0", "61 °C", "engine-1", "down", "tts", "org/x-GGUF",
                     "recent swaps", "for b", "running 2", "queued 3"):
        assert expected in text, expected


def _with_placement(placement: dict[str, object]) -> dict[str, object]:
    status = json.loads(json.dumps(STATUS))
    for m in status["engines"][0]["models"]:
        if m["model"] == "b":
            m["placement"] = placement
    return dict(status)


def test_ps_shows_where_a_model_is_and_its_cpu_gpu_split() -> None:
    spanning = {"devices": [{"index": 0, "bytes": 3 * 2**30}, {"index": 1, "bytes": 2**30}],
                "host_bytes": 2**30}
    view = overview(_with_placement(spanning), [])
    (b,) = view["engines"][0]["models"]
    assert (b["placement"], b["processor"]) == ("gpu0+gpu1", "20%/80% CPU/GPU")
    console = Console(width=220, record=True)
    console.print(render(view))
    text = console.export_text()
    assert "PLACEMENT" in text and "PROCESSOR" in text
    assert "gpu0+gpu1" in text and "20%/80% CPU/GPU" in text


def test_a_model_on_one_gpu_is_100_percent_gpu() -> None:
    view = overview(_with_placement({"devices": [{"index": 1, "bytes": 5}]}), [])
    (b,) = view["engines"][0]["models"]
    assert (b["placement"], b["processor"]) == ("gpu1", "100% GPU")


def test_ps_shows_each_device_of_an_engines_group() -> None:
    status = json.loads(json.dumps(STATUS))
    card = {"kind": "simulated", "total_bytes": 4 * 2**30, "used_bytes": 2**30}
    status["engines"][0]["devices"] = [{**card, "index": 0, "name": "left card"},
                                       {**card, "index": 1, "name": "right card"}]
    view = overview(status, [])
    assert [d["index"] for d in view["devices"][0]["devices"]] == [0, 1]
    console = Console(width=220, record=True)
    console.print(render(view))
    text = console.export_text()
    assert "gpu0" in text and "left card" in text and "right card" in text


def test_an_empty_device_shows_its_memory_not_a_dash() -> None:
    """`modelyard ps` showed "-" for a device with nothing loaded (0 used read as unknown)."""
    from modelyard.cli.status import bar

    assert bar(0, 24 * 2**30).startswith("[" + "." * 20 + "] 0")
    assert bar(None, 24 * 2**30) == "-" and bar(5, None) == "-"
