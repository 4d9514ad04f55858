"""`llama-server --list-devices`: the parser on captured listings, and the runner against real
processes (a fake binary printing a listing, one printing something else, one that hangs)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from modelyard.hw.backend_devices import gpu_devices, llama_server_devices, parse_list_devices

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

DATA = Path(__file__).parent.parent / "data" / "list_devices"
MIB = 2**20


def listing(name: str) -> str:
    return (DATA / name).read_text()


def test_a_cuda_build_lists_its_gpu() -> None:
    (dev,) = parse_list_devices(listing("cuda_h200.txt")) or ()
    assert (dev.name, dev.description, dev.api) == ("CUDA0", "NVIDIA H200", "cuda")
    assert dev.total_bytes == 143771 * MIB and dev.free_bytes == 142890 * MIB


def test_a_cpu_build_lists_none() -> None:
    assert parse_list_devices(listing("cpu_only.txt")) == ()


def test_a_description_with_parentheses_and_a_blas_device() -> None:
    (vk,) = parse_list_devices(listing("vulkan_llvmpipe.txt")) or ()
    assert vk.description == "llvmpipe (LLVM 15.0.6, 256 bits)" and vk.api == "vulkan"
    found = parse_list_devices(listing("two_cuda_blas.txt")) or ()
    assert [d.name for d in found] == ["CUDA0", "CUDA1", "BLAS"]
    assert [d.name for d in gpu_devices(found)] == ["CUDA0", "CUDA1"]


@pytest.mark.parametrize("text", ["", "error: unknown argument: --list-devices\n",
                                  "usage: llama-server [options]\n"])
def test_output_that_is_not_a_listing_is_unknown(text: str) -> None:
    assert parse_list_devices(text) is None


def fake_binary(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "llama-server"
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_the_runner_reads_a_listing_under_the_visible_devices(tmp_path: Path) -> None:
    binary = fake_binary(tmp_path, (
        "import os, sys\n"
        "print('ggml_cuda_init: found 1 CUDA devices', file=sys.stderr)\n"
        "print('Available devices:')\n"
        "if os.environ.get('CUDA_VISIBLE_DEVICES') != '':\n"
        "    print('  CUDA0: NVIDIA H200 (143771 MiB, 142890 MiB free)')\n"
        "else:\n"
        "    print('  (none)')\n"))
    (dev,) = llama_server_devices(binary, {"CUDA_VISIBLE_DEVICES": "0"}) or ()
    assert dev.api == "cuda"
    assert llama_server_devices(binary, {"CUDA_VISIBLE_DEVICES": ""}) == ()


def test_a_binary_that_fails_or_hangs_is_unknown(tmp_path: Path) -> None:
    failing = fake_binary(tmp_path, "import sys\nprint('Available devices:')\nsys.exit(1)\n")
    assert llama_server_devices(failing) is None
    hanging = tmp_path / "hangs"
    hanging.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(30)\n")
    hanging.chmod(0o755)
    assert llama_server_devices(hanging, timeout_s=0.5) is None
    assert llama_server_devices(tmp_path / "missing") is None
