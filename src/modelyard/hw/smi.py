"""Device probe through the `nvidia-smi` command line tool.

Used where NVML bindings are unavailable (e.g. in the torch-free front, or on hosts without
pynvml). The parser is pure and tested on captured output; the runner never raises, because a
missing or wedged driver must degrade to "no GPUs", not crash the caller.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from typing import Any

from modelyard.types import DeviceInfo

QUERY_GPU_FIELDS: tuple[str, ...] = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "memory.free",
    "utilization.gpu",
    "temperature.gpu",
)

NVIDIA_SMI_ARGS: tuple[str, ...] = (
    "nvidia-smi",
    "--query-gpu=" + ",".join(QUERY_GPU_FIELDS),
    "--format=csv,noheader,nounits",
)

_MIB = 1024 * 1024

# Values nvidia-smi prints instead of a number. Any bracketed token ("[Unknown Error]",
# "[Insufficient Permissions]", "[GPU is lost]", ...) is treated the same way.
_NULL_TOKENS = frozenset({"", "n/a", "not supported", "unknown error"})


def _clean(token: str) -> str | None:
    value = token.strip()
    if value.startswith("[") and value.endswith("]"):
        return None
    if value.lower() in _NULL_TOKENS:
        return None
    return value


def _to_int(token: str) -> int | None:
    value = _clean(token)
    if value is None:
        return None
    try:
        # float() first: some driver versions print e.g. "45.00" for sensors.
        return int(float(value))
    except ValueError:
        return None


def _mib_to_bytes(token: str) -> int | None:
    mib = _to_int(token)
    return None if mib is None else mib * _MIB


def _parse_line(line: str) -> DeviceInfo | None:
    parts = line.split(",")
    n = len(QUERY_GPU_FIELDS)
    if len(parts) < n:
        return None  # a warning or error line, not a row
    # The product name is the only free-text column; rejoin it should it ever contain a comma.
    extra = len(parts) - n
    name = ",".join(parts[2 : 3 + extra]).strip()
    index_s, uuid_s = parts[0], parts[1]
    total_s, used_s, free_s, util_s, temp_s = parts[3 + extra :]
    index = _to_int(index_s)
    total = _mib_to_bytes(total_s)
    if index is None or total is None:
        # A row without an index or total memory (e.g. "[GPU is lost]") is not a usable device.
        return None
    return DeviceInfo(
        index=index,
        uuid=_clean(uuid_s),
        name=name,
        total_bytes=total,
        used_bytes=_mib_to_bytes(used_s),
        free_bytes=_mib_to_bytes(free_s),
        utilization_pct=_to_int(util_s),
        temperature_c=_to_int(temp_s),
        kind="cuda",
    )


def parse_query_gpu_csv(text: str) -> list[DeviceInfo]:
    """Parse `nvidia-smi --query-gpu=<QUERY_GPU_FIELDS> --format=csv,noheader,nounits` output.

    Memory columns are MiB and are returned in bytes. Unreadable values become None; lines that
    are not device rows are skipped. Devices are returned ordered by index.
    """
    devices = [d for d in (_parse_line(line) for line in text.splitlines()) if d is not None]
    return sorted(devices, key=lambda d: d.index)


RunFn = Callable[..., "subprocess.CompletedProcess[Any]"]


def query_gpus(run: RunFn = subprocess.run, timeout_s: float = 5.0) -> list[DeviceInfo]:
    """Run nvidia-smi and parse its output; [] when it is absent, fails or hangs.

    `run` is injectable (same signature as subprocess.run) so tests can feed captured output.
    Note nvidia-smi ignores CUDA_VISIBLE_DEVICES: indexes are the driver's, not CUDA's.
    """
    try:
        proc = run(
            list(NVIDIA_SMI_ARGS),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.SubprocessError, ValueError):
        # OSError covers a missing binary and permission errors; SubprocessError covers
        # TimeoutExpired (a hung driver); ValueError covers undecodable output.
        return []
    if proc.returncode != 0 or not proc.stdout:
        return []
    stdout = proc.stdout
    if isinstance(stdout, bytes):
        stdout = stdout.decode("utf-8", errors="replace")
    return parse_query_gpu_csv(str(stdout))


# The driver and each GPU's compute capability, asked apart from the main query: `compute_cap`
# is a newer field (drivers from 2021), and an unknown field fails the whole query.
DRIVER_ARGS: tuple[str, ...] = (
    "nvidia-smi", "--query-gpu=index,driver_version,compute_cap",
    "--format=csv,noheader,nounits",
)
DRIVER_ONLY_ARGS: tuple[str, ...] = (
    "nvidia-smi", "--query-gpu=index,driver_version", "--format=csv,noheader,nounits",
)


def parse_driver_csv(text: str) -> tuple[str | None, dict[int, str]]:
    """(driver version, {index: compute capability}) from DRIVER_ARGS' (or DRIVER_ONLY_ARGS')
    output; unreadable values are left out."""
    driver: str | None = None
    caps: dict[int, str] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2:
            continue
        index = _to_int(parts[0])
        if index is None:
            continue
        driver = driver or _clean(parts[1])
        cap = _clean(parts[2]) if len(parts) > 2 else None
        if cap is not None:
            caps[index] = cap
    return driver, caps


def query_driver(run: RunFn = subprocess.run,
                 timeout_s: float = 5.0) -> tuple[str | None, dict[int, str]]:
    """The driver's version and the GPUs' compute capabilities by nvidia-smi; (None, {}) when
    it is absent, fails or hangs."""
    for args in (DRIVER_ARGS, DRIVER_ONLY_ARGS):
        try:
            proc = run(list(args), capture_output=True, text=True, timeout=timeout_s,
                       check=False)
        except (OSError, subprocess.SubprocessError, ValueError):
            return None, {}
        if proc.returncode == 0 and proc.stdout:
            stdout = proc.stdout
            if isinstance(stdout, bytes):
                stdout = stdout.decode("utf-8", errors="replace")
            return parse_driver_csv(str(stdout))
    return None, {}
