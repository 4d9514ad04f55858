"""Which devices a llama.cpp build can really use: `llama-server --list-devices`.

A binary built without a GPU backend lists no device, whatever GPUs the driver reports; one built
with CUDA lists `CUDA0 …` for each GPU its CUDA_VISIBLE_DEVICES lets it see. The engine asks once
per binary (cached by its path, size and mtime, and the visible devices), so that it never puts
layers "on a GPU" with a build that would keep them in host RAM (DESIGN.md §3 rule 15).

The parser is pure and tested on captured output. The runner never raises: a binary that cannot
run, hangs past the timeout or prints something that is not llama-server's listing gives
`None`, "unknown", which the caller treats as it documents.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from modelyard.hw.devices import env_with_visible

_MIB = 1024 * 1024

# `  CUDA0: NVIDIA H200 (143771 MiB, 142890 MiB free)` (common/arg.cpp
# common_print_available_devices); `  (none)` when only the CPU is there.
_HEADER = "Available devices:"
_DEVICE = re.compile(r"^\s+(?P<name>[A-Za-z][\w-]*):\s+(?P<desc>.*?)\s+"
                     r"\((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)\s*$")

# ggml's device names by backend: the prefix says which GPU API the build was made with.
_GPU_APIS: tuple[tuple[str, str], ...] = (
    ("CUDA", "cuda"), ("ROCm", "rocm"), ("HIP", "rocm"), ("Vulkan", "vulkan"),
    ("SYCL", "sycl"), ("MTL", "metal"), ("Metal", "metal"), ("OpenCL", "opencl"),
    ("MUSA", "musa"), ("CANN", "cann"),
)


@dataclass(frozen=True)
class BackendDevice:
    """One device a backend build can open, as it reports it."""

    name: str  # the backend's own name: CUDA0, Vulkan0, ROCm0
    description: str  # e.g. "NVIDIA H200"
    total_bytes: int
    free_bytes: int

    @property
    def api(self) -> str | None:
        """The GPU API (cuda, rocm, vulkan, …), or None for a device that is not a GPU (BLAS,
        RPC)."""
        return next((api for prefix, api in _GPU_APIS if self.name.startswith(prefix)), None)


def parse_list_devices(text: str) -> tuple[BackendDevice, ...] | None:
    """The devices in `--list-devices` output; None when the text is not that listing (an older
    build, another program, a crash before the listing)."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == _HEADER)
    except StopIteration:
        return None
    found: list[BackendDevice] = []
    for line in lines[start + 1:]:
        if line.strip() == "(none)":
            break
        match = _DEVICE.match(line)
        if match is None:
            if line.startswith((" ", "\t")):
                continue  # a device line in a shape we do not know: skip it, not the listing
            break
        found.append(BackendDevice(match["name"], match["desc"],
                                   int(match["total"]) * _MIB, int(match["free"]) * _MIB))
    return tuple(found)


def gpu_devices(devices: tuple[BackendDevice, ...]) -> tuple[BackendDevice, ...]:
    return tuple(d for d in devices if d.api is not None)


@functools.lru_cache(maxsize=32)
def _listed(binary: str, size: int, mtime_ns: int, visible: str | None,
            timeout_s: float) -> tuple[BackendDevice, ...] | None:
    env = env_with_visible(visible)
    try:
        done = subprocess.run([binary, "--list-devices"], capture_output=True, text=True,
                              timeout=timeout_s, check=False, env=env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    # Its log lines (ggml_cuda_init: …) go to stderr, the listing to stdout.
    return parse_list_devices(done.stdout) if done.returncode == 0 else None


def llama_server_devices(
    binary: Path, env: Mapping[str, str] | None = None, timeout_s: float = 15.0
) -> tuple[BackendDevice, ...] | None:
    """What `binary --list-devices` lists under `env`'s CUDA_VISIBLE_DEVICES (the caller's own
    when `env` has none); None when unknown. Asked once per binary file and visible set."""
    try:
        stat = binary.stat()
    except OSError:
        return None
    source = env if env is not None and "CUDA_VISIBLE_DEVICES" in env else os.environ
    return _listed(str(binary), stat.st_size, stat.st_mtime_ns,
                   source.get("CUDA_VISIBLE_DEVICES"), timeout_s)
