"""GET /v1/status, `modelyard ps` and `modelyard top` on a real server: two models on a small
simulated GPU, so there is a swap to report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from tests.integration.harness import HELLO
from tests.integration.test_scheduling import GIB, serving, sim_config, sim_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def chat(url: str, model: str) -> None:
    r = httpx.post(url + "/v1/chat/completions", timeout=30,
                   json={"model": model, "messages": HELLO, "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_one_json_then_ps_and_top_draw_it(tmp_path: Path, files: Path) -> None:
    cfg = sim_config(sim_model("big", 5, files), sim_model("other", 5, files))
    with serving(tmp_path, cfg) as server:
        chat(server.url, "big")
        chat(server.url, "other")  # evicts big
        view = httpx.get(server.url + "/v1/status", timeout=30).json()
        assert view["summary"]["engines_up"] == 1 and view["summary"]["models_loaded"] == 1
        (device,) = view["devices"]
        assert device["name"] == "simulated GPU 0" and device["total_bytes"] == 8 * GIB
        assert device["holds"] == [{"model": "other", "bytes": 5 * GIB}]
        assert [m["model"] for m in view["engines"][0]["models"]] == ["other"]
        assert view["scheduler"]["evictions"] == 1
        assert view["scheduler"]["recent_swaps"][-1]["unloaded"] == "big"
        assert view["queues"]["big"]["admitted_total"] == 1 and view["pulls"] == []

        env = {**os.environ, "COLUMNS": "200", "MODELYARD_HOME": str(server.home)}
        for args in (["ps"], ["top", "--count", "2", "--interval", "0.1"]):
            out = subprocess.run([sys.executable, "-m", "modelyard", *args, "--url", server.url],
                                 capture_output=True, text=True, timeout=60, env=env)
            assert out.returncode == 0, out.stderr
            for expected in ("simulated GPU 0", "other", "recent swaps", "for other"):
                assert expected in out.stdout, (args, expected, out.stdout)
