#!/usr/bin/env python3
"""Which accelerator the set-up builds and installs for (issue 30, DESIGN.md §3 rule 15).

Standard library only: it runs before any virtual environment exists, from `make install` and
`scripts/provide-llama-server.sh`. It looks at the machine, never changes it:

- an NVIDIA GPU: `nvidia-smi --query-gpu=name,compute_cap` (compute capability 9.0 -> arch 90);
- a CUDA toolkit: `nvcc` on PATH, else in $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin;
- an AMD GPU: `rocminfo` (its gfx targets), else `rocm-smi`; the ROCm toolkit: `hipcc`;
- Vulkan: the loader and its development link (`ldconfig -p`: libvulkan.so.1, libvulkan.so)
  plus the shader compiler `glslc` make the toolkit; `vulkaninfo --summary`, where installed,
  tells whether a Vulkan GPU (not a software device such as llvmpipe) is there.

The rules, in order:
- MODELYARD_ACCEL=cpu|cuda|vulkan|rocm overrides detection. An override whose toolkit is missing
  is an error (exit 2, naming what to install): a build the user asked for is never swapped for
  another one silently.
- NVIDIA GPU + nvcc -> cuda, for the detected architectures only (`<cc>-real`, minutes to build).
- NVIDIA or AMD GPU without its own toolkit but with Vulkan's -> vulkan (the portable fallback).
- AMD GPU + hipcc -> rocm, for the detected gfx targets.
- a Vulkan-only GPU (Intel, ...) + Vulkan's toolkit -> vulkan.
- a GPU and no toolkit -> cpu, with a loud warning on stderr naming what to install.
- a toolkit without a GPU -> cpu (CI's machines carry a CUDA compiler and no GPU).

Modes (what goes to stdout; notes and warnings go to stderr):
  detect_accel.py                               variant=... and what was seen, key=value lines
  detect_accel.py --plan --version V --cache D  the llama-server build plan: variant=, dest=,
                                                then one cmake=ARG line per cmake argument
  detect_accel.py --torch-variant               cpu or cuda: which torch `make install` installs

Environment: MODELYARD_ACCEL (override), MODELYARD_CUDA_ARCHS (e.g. "90" or "8.6,8.9": build for
these instead of the detected GPUs, e.g. a CUDA build on a machine without one),
MODELYARD_AMDGPU_TARGETS (e.g. "gfx1100"), MODELYARD_ACCEL_SEARCH (the folders searched after
PATH, ':'-separated; the tests set it empty so that this machine's own toolkits stay out).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

VARIANTS = ("cpu", "cuda", "vulkan", "rocm")

# The CPU part of every build (GPU builds too: offloaded layers run there). A native build
# (-march=native) dies with SIGILL on VMs whose CPU advertises AMX/AVX-512 it cannot execute, so
# the baseline is a portable AVX2; static libraries keep the cached binary self-contained.
COMMON_CMAKE = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
    "-DGGML_AVX512=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
]

INSTALL_CUDA = (
    "CUDA: Debian's `nvidia-cuda-toolkit` (non-free; apt-get install nvidia-cuda-toolkit) or "
    "NVIDIA's CUDA toolkit (nvcc in /usr/local/cuda/bin); or, without root, the compiler and "
    "headers from PyPI into a build-only venv: python3 -m venv ~/.cache/modelyard/cuda-build && "
    "~/.cache/modelyard/cuda-build/bin/pip install nvidia-cuda-nvcc nvidia-cuda-runtime "
    "nvidia-cublas, then set CUDA_HOME to the folder holding its bin/nvcc"
)
INSTALL_VULKAN = "Vulkan: Debian's `libvulkan-dev glslc` (apt-get install libvulkan-dev glslc)"
INSTALL_ROCM = (
    "ROCm: AMD's ROCm (hipcc, hipBLAS, rocBLAS in /opt/rocm), or Debian 13's "
    "`hipcc libhipblas-dev librocblas-dev`"
)


class Refused(Exception):
    """An override that cannot be honoured; the message says what to install."""


@dataclass
class Machine:
    nvidia: list[tuple[str, str]] = field(default_factory=list)  # (name, compute capability)
    nvidia_smi_error: str = ""
    amd_gfx: list[str] = field(default_factory=list)
    amd_gpu: bool = False
    vulkan_gpus: list[str] = field(default_factory=list)
    nvcc: str = ""
    hipcc: str = ""
    glslc: str = ""
    vulkan_loader: bool = False
    vulkan_dev: bool = False

    @property
    def vulkan_toolkit(self) -> bool:
        return bool(self.glslc) and self.vulkan_loader and self.vulkan_dev

    def vulkan_missing(self) -> str:
        missing = [what for what, ok in (("glslc", self.glslc), ("libvulkan1", self.vulkan_loader),
                                         ("libvulkan-dev", self.vulkan_dev)) if not ok]
        return " ".join(missing)


@dataclass
class Choice:
    variant: str
    archs: list[str] = field(default_factory=list)  # CUDA: "90"; ROCm: "gfx1100"
    reason: str = ""
    warnings: list[str] = field(default_factory=list)


def search_dirs() -> list[str]:
    """PATH, then the usual toolkit homes (or MODELYARD_ACCEL_SEARCH where set)."""
    extra = os.environ.get("MODELYARD_ACCEL_SEARCH")
    if extra is None:
        homes = [os.environ.get(v, "") for v in ("CUDA_HOME", "CUDA_PATH", "ROCM_PATH")]
        extra = ":".join([f"{h}/bin" for h in homes if h]
                         + ["/usr/local/cuda/bin", "/opt/rocm/bin", "/usr/sbin", "/sbin"])
    dirs = os.environ.get("PATH", "").split(":") + extra.split(":")
    return [d for d in dirs if d]


def which(tool: str) -> str:
    return shutil.which(tool, path=":".join(search_dirs())) or ""


def run(argv: list[str], timeout: float = 20) -> tuple[int, str]:
    """(exit code, stdout); a tool that cannot run is exit code 127."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return done.returncode, done.stdout if done.returncode == 0 else done.stdout + done.stderr


def probe() -> Machine:
    m = Machine()
    smi = which("nvidia-smi")
    if smi:
        code, out = run([smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"])
        if code == 0:
            for line in out.splitlines():
                name, _, cc = line.rpartition(",")
                if name.strip():
                    m.nvidia.append((name.strip(), cc.strip()))
        else:
            # An old driver without the compute_cap field still names its GPUs.
            code2, out2 = run([smi, "--query-gpu=name", "--format=csv,noheader"])
            if code2 == 0 and out2.strip():
                m.nvidia = [(line.strip(), "") for line in out2.splitlines() if line.strip()]
            else:
                m.nvidia_smi_error = (out.strip().splitlines() or [f"exit {code}"])[0]
    rocminfo = which("rocminfo")
    if rocminfo:
        code, out = run([rocminfo])
        if code == 0:
            m.amd_gfx = sorted(set(re.findall(r"^\s*Name:\s+(gfx[0-9a-f]+)\s*$", out, re.M)))
    if not m.amd_gfx and (rocm_smi := which("rocm-smi")):
        code, out = run([rocm_smi, "--showproductname"])
        m.amd_gpu = code == 0 and bool(re.search(r"^GPU\[\d+\]", out, re.M))
    m.amd_gpu = m.amd_gpu or bool(m.amd_gfx)
    vulkaninfo = which("vulkaninfo")
    if vulkaninfo:
        code, out = run([vulkaninfo, "--summary"])
        if code == 0:
            # Device blocks: deviceType first, deviceName after; a CPU type is a software driver.
            kind = ""
            for line in out.splitlines():
                key, _, value = (s.strip() for s in line.partition("="))
                if key == "deviceType":
                    kind = value
                elif key == "deviceName" and kind.endswith("_GPU"):
                    m.vulkan_gpus.append(value)
    m.nvcc, m.hipcc, m.glslc = which("nvcc"), which("hipcc"), which("glslc")
    ldconfig = which("ldconfig")
    if ldconfig:
        _, out = run([ldconfig, "-p"])
        libs = {line.split()[0] for line in out.splitlines()[1:] if line.strip()}
        m.vulkan_loader = "libvulkan.so.1" in libs
        m.vulkan_dev = "libvulkan.so" in libs
    return m


def cuda_archs(m: Machine) -> list[str]:
    """CUDA architectures: MODELYARD_CUDA_ARCHS, else the detected GPUs' (9.0 -> 90)."""
    given = os.environ.get("MODELYARD_CUDA_ARCHS", "")
    caps = re.split(r"[\s,;]+", given.strip()) if given.strip() else [cc for _, cc in m.nvidia]
    archs = {cc.replace(".", "").removesuffix("-real") for cc in caps if cc}
    return sorted(archs, key=lambda a: (int(re.sub(r"\D", "", a) or 0), a))


def amd_targets(m: Machine) -> list[str]:
    given = os.environ.get("MODELYARD_AMDGPU_TARGETS", "").strip()
    return sorted(set(re.split(r"[\s,;]+", given))) if given else m.amd_gfx


def describe_nvidia(m: Machine) -> str:
    return ", ".join(f"{name} ({cc})" if cc else name for name, cc in m.nvidia)


def loud(lines: list[str]) -> str:
    bar = "!" * 78
    return "\n".join([bar, f"! WARNING: {lines[0]}", *(f"! {line}" for line in lines[1:]), bar])


def choose(m: Machine, override: str) -> Choice:
    if override:
        return choose_override(m, override)
    if m.nvidia:
        gpus = f"NVIDIA GPU: {describe_nvidia(m)}"
        if m.nvcc:
            archs = cuda_archs(m)
            note = [] if archs else [
                f"{gpus}: no compute capability reported; building for llama.cpp's default "
                "CUDA architectures (slow); set MODELYARD_CUDA_ARCHS to narrow it"]
            return Choice("cuda", archs, f"{gpus}; nvcc: {m.nvcc}", note)
        if m.vulkan_toolkit:
            return Choice("vulkan", reason=f"{gpus}; no nvcc, Vulkan toolkit present", warnings=[
                f"{gpus} but no CUDA compiler (nvcc): building the Vulkan backend instead. "
                f"For CUDA, install {INSTALL_CUDA}"])
        return no_toolkit(gpus, [INSTALL_CUDA, INSTALL_VULKAN], m)
    if m.amd_gpu:
        gpus = f"AMD GPU: {' '.join(m.amd_gfx) or 'gfx target unknown'}"
        targets = amd_targets(m)
        if m.hipcc and targets:
            return Choice("rocm", targets, f"{gpus}; hipcc: {m.hipcc}")
        if m.hipcc:  # hipcc is there, but which gfx to build for is not known
            installs = ["the gfx target: set MODELYARD_AMDGPU_TARGETS (e.g. gfx1100)"]
        else:
            installs = [INSTALL_ROCM]
        if m.vulkan_toolkit:
            return Choice("vulkan", reason=f"{gpus}; no usable hipcc, Vulkan toolkit present",
                          warnings=[f"{gpus}: building for Vulkan; for ROCm, {installs[0]}"])
        return no_toolkit(gpus, [*installs, INSTALL_VULKAN], m)
    if m.vulkan_gpus:
        gpus = f"Vulkan GPU: {', '.join(m.vulkan_gpus)}"
        if m.vulkan_toolkit:
            return Choice("vulkan", reason=gpus)
        return no_toolkit(gpus, [INSTALL_VULKAN], m)
    toolkits = [t for t, ok in (("nvcc", m.nvcc), ("hipcc", m.hipcc),
                                ("Vulkan", m.vulkan_toolkit)) if ok]
    reason = "no GPU" + (f" (toolkit without a GPU: {', '.join(toolkits)})" if toolkits else "")
    warnings = []
    if m.nvidia_smi_error:
        warnings.append(loud([
            f"nvidia-smi is installed but failed: {m.nvidia_smi_error}",
            "The NVIDIA driver may be broken or not loaded; building llama-server for the CPU.",
        ]))
    return Choice("cpu", reason=reason, warnings=warnings)


def no_toolkit(gpus: str, installs: list[str], m: Machine) -> Choice:
    lines = [
        f"{gpus} is present, but no toolkit to build llama-server for it was found",
        f"(nvcc: {'yes' if m.nvcc else 'no'}, hipcc: {'yes' if m.hipcc else 'no'}, "
        f"Vulkan: {'yes' if m.vulkan_toolkit else 'missing ' + m.vulkan_missing()}).",
        "Building llama-server for the CPU: models will run on the CPU, not on the GPU.",
        "To use the GPU, one of these, then `make llama-server` again:",
        *(f"  - {how}" for how in installs),
        "(MODELYARD_ACCEL=cpu chooses the CPU build and silences this warning.)",
    ]
    return Choice("cpu", reason=f"{gpus}; no GPU toolkit", warnings=[loud(lines)])


def choose_override(m: Machine, override: str) -> Choice:
    reason = f"MODELYARD_ACCEL={override}"
    if override == "cpu":
        return Choice("cpu", reason=reason)
    if override == "cuda":
        if not m.nvcc:
            raise Refused(f"{reason}, but no CUDA compiler (nvcc) was found on PATH, in "
                          f"$CUDA_HOME/bin or /usr/local/cuda/bin. Install {INSTALL_CUDA}.")
        archs = cuda_archs(m)
        if not archs:
            raise Refused(f"{reason}, but no NVIDIA GPU reports a compute capability: name the "
                          "architectures to build for, e.g. MODELYARD_CUDA_ARCHS=90")
        return Choice("cuda", archs, reason)
    if override == "vulkan":
        if not m.vulkan_toolkit:
            raise Refused(f"{reason}, but the Vulkan toolkit is incomplete (missing: "
                          f"{m.vulkan_missing()}). Install {INSTALL_VULKAN}.")
        return Choice("vulkan", reason=reason)
    if override == "rocm":
        if not m.hipcc:
            raise Refused(f"{reason}, but hipcc was not found. Install {INSTALL_ROCM}.")
        targets = amd_targets(m)
        if not targets:
            raise Refused(f"{reason}, but no AMD GPU reports a gfx target: name it, e.g. "
                          "MODELYARD_AMDGPU_TARGETS=gfx1100")
        return Choice("rocm", targets, reason)
    raise Refused(f"MODELYARD_ACCEL={override!r}: expected one of {', '.join(VARIANTS)}")


def tag(choice: Choice) -> str:
    """The cache folder's suffix: it says which build lies there."""
    if choice.variant == "cpu":
        return "avx2"  # the name the CPU cache has always had (CI's cache stays valid)
    if choice.variant == "cuda":
        return "-".join(["cuda", *(f"sm{a}" for a in choice.archs)])
    if choice.variant == "rocm":
        return "-".join(["rocm", *choice.archs])
    return choice.variant


def cmake_args(choice: Choice, m: Machine) -> list[str]:
    args = list(COMMON_CMAKE)
    if choice.variant != "cpu" and which("ninja"):
        args.insert(0, "-GNinja")  # GNU make may be missing on GPU images
    elif choice.variant == "cpu" and not which("make") and which("ninja"):
        args.insert(0, "-GNinja")
    if choice.variant == "cuda":
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={m.nvcc}",
                 "-DGGML_CUDA_FA_ALL_QUANTS=OFF"]
        if choice.archs:
            args.append("-DCMAKE_CUDA_ARCHITECTURES=" + ";".join(f"{a}-real" for a in choice.archs))
    elif choice.variant == "vulkan":
        args.append("-DGGML_VULKAN=ON")
    elif choice.variant == "rocm":
        args += ["-DGGML_HIP=ON", "-DAMDGPU_TARGETS=" + ";".join(choice.archs)]
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--plan", action="store_true", help="print the llama-server build plan")
    mode.add_argument("--torch-variant", action="store_true",
                      help="print cpu or cuda: the torch build `make install` installs")
    parser.add_argument("--version", default="", help="llama-server version (with --plan)")
    parser.add_argument("--cache", default="", help="the cache folder (with --plan)")
    args = parser.parse_args(argv)

    override = os.environ.get("MODELYARD_ACCEL", "").strip().lower()
    machine = probe()
    if args.torch_variant:
        # torch's CUDA wheels carry their own CUDA runtime: an NVIDIA GPU (a driver) is enough,
        # no toolkit needed. PyPI has no ROCm or Vulkan torch: those machines get the CPU build.
        if override and override not in VARIANTS:
            print(f"detect_accel: ERROR: MODELYARD_ACCEL={override!r}: expected one of "
                  f"{', '.join(VARIANTS)}", file=sys.stderr)
            return 2
        print("cuda" if override == "cuda" or (not override and machine.nvidia) else "cpu")
        return 0

    try:
        choice = choose(machine, override)
    except Refused as exc:
        print(f"detect_accel: ERROR: {exc}", file=sys.stderr)
        return 2
    for warning in choice.warnings:
        print(warning if warning.startswith("!") else f"detect_accel: note: {warning}",
              file=sys.stderr)
    out = [f"variant={choice.variant}", f"reason={choice.reason}"]
    if choice.archs:
        out.append(f"archs={' '.join(choice.archs)}")
    out.append(f"tag={tag(choice)}")
    if args.plan:
        if args.version and args.cache:
            out.append(f"dest={args.cache}/llama-server-{args.version}-{tag(choice)}/llama-server")
        out += [f"cmake={arg}" for arg in cmake_args(choice, machine)]
    else:
        out += [f"nvidia={describe_nvidia(machine)}", f"amd={' '.join(machine.amd_gfx)}",
                f"vulkan_gpus={', '.join(machine.vulkan_gpus)}", f"nvcc={machine.nvcc}",
                f"hipcc={machine.hipcc}",
                f"vulkan_toolkit={'yes' if machine.vulkan_toolkit else 'no'}"]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
