"""Never place on a device a backend cannot use (DESIGN.md §3.15), on a real `modelyard serve`
with simulated GPUs and `probe_backend_devices: always`: the engine asks its llama-server
`--list-devices`, here a real executable that answers in llama-server's format and otherwise
runs the fake llama-server (tests/fakes/fake_backend.py).

A build that lists no GPU: the GGUF model is placed whole in host RAM (no GPU flags, no claim on
the simulated GPU, the child sees no device) and status, `modelyard ps` and `/api/ps` say why,
while a backend taken as configured (`openai`) still goes to the GPU. A build that lists a CUDA
device: the model goes to the GPU as before."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.harness import (
    HELLO,
    config,
    model_status,
    module_server,
    process_env,
    status,
)
from tests.support import FAKE_BACKEND, Server, fake_model, tiny_gguf

from modelyard.hw.simulated import SimulatedGpu

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MIB = 2**20
GGUF_BYTES = 512 * MIB
CPU_ONLY = "Available devices:\n  (none)\n"
CUDA = "Available devices:\n  CUDA0: NVIDIA H200 (143771 MiB, 142890 MiB free)\n"
GPU_FLAGS = ("--n-gpu-layers", "-ngl", "--main-gpu", "--split-mode", "--tensor-split")


def fake_llama_server(path: Path, listing: str) -> Path:
    """An executable that answers `--list-devices` with `listing` (stdout, as llama-server)
    and otherwise execs the fake llama-server with its arguments (same pid)."""
    quoted = listing.replace("'", "'\\''")
    path.write_text(
        "#!/bin/sh\n"
        'case " $* " in\n'
        f"  *' --list-devices '*) printf '%s' '{quoted}'; exit 0 ;;\n"
        "  *' --help '*|*' --version '*) echo 'fake llama-server'; exit 0 ;;\n"
        "esac\n"
        f'exec "{sys.executable}" "{FAKE_BACKEND}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path



def served(tmp: pytest.TempPathFactory, listing: str) -> Iterator[tuple[Server, Path]]:
    root = tmp.mktemp("reach")
    binary = fake_llama_server(root / "llama-server", listing)
    gguf = {"id": "gguf", "backend": "llamacpp", "path": str(tiny_gguf(root / "m.gguf")),
            "vram_bytes": GGUF_BYTES, "extra_args": ["--claim-bytes", str(GGUF_BYTES)]}
    plain = fake_model("plain", "--claim-bytes", str(GGUF_BYTES), vram_bytes=GGUF_BYTES)
    cfg = config(gguf, plain, simulate_gpus="1x8GiB", probe_backend_devices="always",
                 llama_server_path=str(binary), keep_alive_s=-1)
    with module_server(tmp, cfg) as server:
        yield server, binary


@pytest.fixture(scope="module")
def cpu_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    yield from served(tmp_path_factory, CPU_ONLY)


@pytest.fixture(scope="module")
def cuda(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    yield from served(tmp_path_factory, CUDA)


def chat(server: Server, model: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": model, "messages": HELLO, "max_tokens": 3})
    assert r.status_code == 200, r.text


def ready(server: Server, model: str) -> dict[str, Any]:
    m = model_status(server, model)
    assert m is not None and m["state"] == "ready", m
    return m


def gpu_claim(server: Server, pid: int) -> int:
    return SimulatedGpu(0, 8 << 30, server.home / "run" / "simgpu" / "0").used_by_pid().get(pid, 0)


def argv_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def api_ps(server: Server, model: str) -> dict[str, Any]:
    rows = httpx.get(server.url + "/api/ps", headers=server.admin_headers, timeout=10).json()
    return dict(next(r for r in rows["models"] if r["name"].startswith(model)))


def test_a_build_without_gpu_support_runs_its_model_on_the_cpu_and_says_why(
        cpu_only: tuple[Server, Path]) -> None:
    server, binary = cpu_only
    why = (f"backend has no GPU support: llama-server at {binary} lists no GPU "
           "(Available devices: (none))")
    chat(server, "gguf")
    m = ready(server, "gguf")
    assert m["cpu_reason"] == why
    placement = m["placement"]
    assert placement["devices"] == [] and placement["host_bytes"] == GGUF_BYTES
    assert placement["split"] == "100% CPU"
    # The child: no GPU flags, no device, nothing claimed on the simulated GPU.
    pid = m["pid"]
    assert not set(argv_of(pid)) & set(GPU_FLAGS), argv_of(pid)
    env = process_env(pid)
    assert env.get("CUDA_VISIBLE_DEVICES") == "" and not env.get("MODELYARD_SIMULATED_GPU_DIR")
    assert gpu_claim(server, pid) == 0
    engine = status(server)["engines"][0]
    assert engine["devices"][0]["used_bytes"] == 0
    assert engine["cpu_backends"]["llamacpp"] == why
    if "transformers" in engine["cpu_backends"]:  # a CPU build of torch too: no backend can
        assert "no backend can use them" in engine["gpu_warning"]
        log = (server.home / "logs" / "engine-0.log").read_text()
        assert "no backend can use them" in log and "!!!!" in log  # loud, at start

    row = api_ps(server, "gguf")
    assert row["size_vram"] == 0 and row["size"] > 0 and row["cpu_reason"] == why

    env = {**os.environ, "MODELYARD_HOME": str(server.home), "MODELYARD_URL": server.url,
           "COLUMNS": "400", "NO_COLOR": "1"}
    done = subprocess.run([sys.executable, "-m", "modelyard", "ps"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    row_line = next(line for line in done.stdout.splitlines()
                    if line.strip("│┃ ").startswith("gguf"))  # its row in the models table
    assert "CPU" in row_line and "GPU" not in row_line, done.stdout
    assert "ON THE CPU" in done.stdout and why in done.stdout


def test_a_backend_taken_as_configured_still_goes_to_the_gpu(
        cpu_only: tuple[Server, Path]) -> None:
    server, _ = cpu_only
    chat(server, "plain")
    m = ready(server, "plain")
    assert m["cpu_reason"] is None and m["placement"]["label"] == "gpu0"
    assert gpu_claim(server, m["pid"]) == GGUF_BYTES
    assert api_ps(server, "plain")["size_vram"] > 0


def test_a_build_that_lists_a_cuda_device_is_placed_on_the_gpu(
        cuda: tuple[Server, Path]) -> None:
    server, _ = cuda
    chat(server, "gguf")
    m = ready(server, "gguf")
    assert m["cpu_reason"] is None
    assert m["placement"]["label"] == "gpu0" and m["placement"]["host_bytes"] == 0
    assert gpu_claim(server, m["pid"]) == GGUF_BYTES
    engine = status(server)["engines"][0]
    assert "llamacpp" not in engine["cpu_backends"] and engine["gpu_warning"] is None
    diag = httpx.get(server.url + "/diag", headers=server.admin_headers, timeout=10).json()
    reach = diag["engines"][0]["backend_reach"]["backends"]["llamacpp"]
    assert reach["devices"] == ["CUDA0: NVIDIA H200"] and reach["reason"] is None
    assert api_ps(server, "gguf")["size_vram"] == GGUF_BYTES
