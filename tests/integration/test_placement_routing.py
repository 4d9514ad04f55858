"""Routing predicts the engine's placement with the engine's own code (issue 16, DESIGN.md
§3.11), on two simulated GPUs with fake model processes that really claim their memory.

engine-0 holds `a` (4 of 6 GiB), which may coexist with `b`: the engine never evicts `a` for `b`,
and 2 GiB is not enough, so it answers NoFit. engine-1 holds `c` (4 of 6 GiB), which it would
evict. The front used to plan Evict(a) on engine-0 (its copy of the view had no
`coexist_with`), score both engines one eviction away, pick the first, and the client got 503
insufficient_memory although engine-1 had room.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.harness import HELLO, config, status
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

GIB = 2**30


def _model(model_id: str, gib: float, **fields: Any) -> dict[str, Any]:
    nbytes = int(gib * GIB)
    return fake_model(model_id, "--claim-bytes", str(nbytes), vram_bytes=nbytes, **fields)


def _chat(server: Server, model: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions",
                      json={"model": model, "messages": HELLO}, timeout=60)


def test_a_cold_model_goes_to_the_engine_that_can_really_make_room(tmp_path: Path) -> None:
    cfg = config(
        _model("a", 4, engine=0, can_coexist_with=["b"]),
        _model("c", 4, engine=1),
        _model("b", 4),
        simulate_gpus="2x6GiB", engine_devices="per_gpu",
    )
    server = Server(tmp_path / "front", cfg)
    try:
        server.wait_healthy()
        for model in ("a", "c"):
            assert _chat(server, model).status_code == 200
        r = _chat(server, "b")
        assert r.status_code == 200, r.text
        engines = {e["name"]: e for e in status(server)["engines"]}
        ready = {name: {m["model"] for m in e["models"] if m["state"] == "ready"}
                 for name, e in engines.items()}
        assert ready == {"engine-0": {"a"}, "engine-1": {"b"}}  # c made room for b
        assert engines["engine-0"]["scheduler"]["no_fit"] == 0  # never asked: predicted
        assert [s["unloaded"] for s in engines["engine-1"]["scheduler"]["recent_swaps"]] == ["c"]
        # what the front predicted from comes across: a may coexist with b
        a = next(m for m in engines["engine-0"]["models"] if m["model"] == "a")
        assert a["coexist_with"] == ["b"]
    finally:
        server.stop()
