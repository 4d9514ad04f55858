"""On NVIDIA GPUs: NVML accounts a child's memory on the device it runs on, llama-server really
splits the demo model over two GPUs, and `--n-gpu-layers` really leaves layers in host RAM.

Skipped where no GPU answers (tests/conftest.py). The llama-server tests need a CUDA build:
`MODELYARD_CUDA_LLAMA_SERVER`, or the configured binary when its `--list-devices` shows a CUDA
device (the pinned build `make test` provides is CPU-only).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from tests.support import poll, require_e2e_artifact

from modelyard.config import DEMO_MODEL_FILE, LlamaCppModel, Settings, cache_dir
from modelyard.engine.backends.openai_server import ChildServer
from modelyard.hw.nvml import NvmlProbe
from modelyard.placement.devices import Placement

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

MIB = 2**20
HOLD = 256 * MIB
# A child that holds HOLD bytes on its (only visible) GPU until its stdin closes.
TORCH_CHILD = (
    "import sys, torch\n"
    "if not torch.cuda.is_available(): sys.exit(3)\n"
    f"x = torch.empty({HOLD}, dtype=torch.uint8, device='cuda')\n"
    "torch.cuda.synchronize(); print('ready', flush=True); sys.stdin.read()\n"
)


@pytest.fixture(scope="module")
def nvml() -> NvmlProbe:
    probe = NvmlProbe()
    if not probe.available():
        pytest.skip("nvidia-ml-py is not installed (pip install modelyard[gpu])")
    return probe


def cuda_llama_server() -> Path:
    given = os.environ.get("MODELYARD_CUDA_LLAMA_SERVER")
    binary = Path(given) if given else Settings().resolve_llama_server()
    if binary is None or not binary.exists():
        pytest.skip("no llama-server binary")
    listed = subprocess.run([str(binary), "--list-devices"], capture_output=True, text=True,
                            timeout=60, check=False)
    if "CUDA" not in listed.stdout + listed.stderr:
        pytest.skip(f"{binary} is not a CUDA build (set MODELYARD_CUDA_LLAMA_SERVER)")
    return binary


def gpu_count(nvml: NvmlProbe) -> int:
    return len({d.index for d in nvml.devices()})


def held_on(nvml: NvmlProbe, pid: int) -> dict[int, int]:
    """Device index → bytes `pid` holds there (devices where it holds nothing left out)."""
    out: dict[int, int] = {}
    for index in sorted({d.index for d in nvml.devices()}):
        procs = nvml.processes(index)
        if pid in procs:
            out[index] = procs[pid]
    return out


def on_device_0(nvml: NvmlProbe, pid: int) -> Callable[[], int | None]:
    return lambda: held_on(nvml, pid).get(0)


def test_nvml_accounts_a_child_on_its_device_only(nvml: NvmlProbe) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    child = subprocess.Popen([sys.executable, "-c", TORCH_CHILD], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            pytest.skip("torch here has no CUDA")
        held = poll(lambda: held_on(nvml, child.pid), 30, "the child on NVML's process list")
        assert set(held) == {0}, held  # on device 0, and on no other
        # usedGpuMemory is None (0) on some drivers; where it is reported it counts the tensor
        assert held[0] == 0 or held[0] >= HOLD
    finally:
        child.kill()
        child.wait()


@pytest.fixture
async def demo(tmp_path: Path) -> AsyncIterator[tuple[Settings, Path]]:
    binary = cuda_llama_server()
    gguf = require_e2e_artifact(cache_dir() / "models" / DEMO_MODEL_FILE, "the demo model")
    yield Settings(home=tmp_path, llama_server_path=binary, default_ctx_size=1024,
                   llama_server_parallel=1), gguf


async def started(settings: Settings, gguf: Path, placement: Placement) -> ChildServer:
    server = ChildServer(LlamaCppModel(id="demo", path=gguf), settings)
    visible = ",".join(str(d) for d in placement.devices)
    server.place(placement, {"CUDA_VISIBLE_DEVICES": visible})
    await server.start()
    return server


async def test_a_real_split_over_two_gpus(nvml: NvmlProbe,
                                          demo: tuple[Settings, Path]) -> None:
    if gpu_count(nvml) < 2:
        pytest.skip("needs two GPUs")
    settings, gguf = demo
    split = Placement(device_bytes=((0, 100 * MIB), (1, 100 * MIB)), layers=(15, 15),
                      total_layers=30)
    server = await started(settings, gguf, split)
    try:
        assert server.pid is not None
        pid = server.pid

        def on_two() -> dict[int, int] | None:
            held = held_on(nvml, pid)
            return held if len(held) >= 2 else None

        assert {0, 1} <= set(poll(on_two, 60, "the split on both devices"))
    finally:
        await server.stop()


async def test_n_gpu_layers_leaves_layers_in_host_ram(nvml: NvmlProbe,
                                                      demo: tuple[Settings, Path]) -> None:
    settings, gguf = demo
    used: dict[str, int] = {}
    for name, placement in (
        ("full", Placement.whole(0, 200 * MIB)),
        ("offload", Placement(device_bytes=((0, 60 * MIB),), host_bytes=140 * MIB,
                              layers=(5,), total_layers=30)),
    ):
        server = await started(settings, gguf, placement)
        try:
            assert server.pid is not None
            used[name] = poll(on_device_0(nvml, server.pid), 60, f"{name} on GPU 0")
        finally:
            await server.stop()
    assert used["offload"] < used["full"], used


async def test_transformers_offload_goes_through_device_map(tmp_path: Path) -> None:
    """An offload placement loads the demo safetensors model with some layers on GPU 0 and the
    rest in host RAM (accelerate's device_map), and it still answers."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch here has no CUDA")
    given = os.environ.get("MODELYARD_DEMO_SAFETENSORS")
    repo = Path(given) if given else cache_dir() / "models" / "smollm2-135m-instruct-safetensors"
    if not (repo / "config.json").is_file():
        pytest.skip("no demo safetensors repo (make demo-safetensors)")
    import httpx

    from modelyard.config import TransformersModel
    from modelyard.engine.backends.transformers.backend import TransformersBackend

    backend = TransformersBackend(
        TransformersModel(id="t", path=repo, quantize="fp16", runtime="transformers"),
        Settings(home=tmp_path))
    # Half the model's 16-bit weights on GPU 0, the rest (and room to spare) in host RAM. A GPU
    # share below the largest layer (the embeddings) is one accelerate fills with nothing.
    weights = sum(f.stat().st_size for f in repo.glob("*.safetensors"))
    if "float32" in (repo / "config.json").read_text():
        weights //= 2  # loaded as 16-bit
    half = weights // 2
    backend.place(Placement(device_bytes=((0, half),), host_bytes=2 * half,
                            layers=(15,), total_layers=30), {})
    await backend.start()
    try:
        model = backend._loaded.model
        where = {str(v) for v in model.hf_device_map.values()}
        assert "cpu" in where and where & {"0", "cuda:0"}, where
        async with httpx.AsyncClient(base_url=backend.url, timeout=120, headers={
                "Authorization": f"Bearer {backend.api_key}"}) as http:  # the load's key
            r = await http.post("/v1/chat/completions", json={
                "model": "t", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
    finally:
        await backend.stop()
