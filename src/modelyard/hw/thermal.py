"""Thermal protection: pause an engine's new work while its CPU or GPU is too hot.

A paused engine finishes what it runs and queues the rest; it is never killed. The policy is a
pure function (`engine_paused`) of the last decision and the current readings, so it is tested
as a table; the sensors behind it are a small class that reads psutil and a GPU reader, or a
JSON file in tests and `--simulate-gpus` runs, where there is nothing real to read.

Hysteresis: an engine pauses when a reading reaches `pause_c` and resumes only when every
reading is below its `resume_c`, so a temperature hovering at the threshold does not flap the
engine between paused and serving on every poll. An unknown temperature (None) never pauses:
many boards have no readable sensor, and refusing all work there would be worse than no guard.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from modelyard.hw.host import cpu_temperature_c


@dataclass(frozen=True)
class Thresholds:
    """Pause at or above `pause_c`; once paused, resume only below `resume_c` (°C)."""

    pause_c: float
    resume_c: float

    def __post_init__(self) -> None:
        if not self.resume_c <= self.pause_c:
            raise ValueError(
                f"thermal thresholds: resume_c ({self.resume_c}) must not exceed "
                f"pause_c ({self.pause_c})"
            )

    def with_overrides(
        self, pause_c: float | None = None, resume_c: float | None = None
    ) -> Thresholds:
        """These thresholds with the configured ends replaced (None keeps the default).

        Overriding only `pause_c` below the default `resume_c` would invert the band; the
        default band width is then kept under the new pause point.
        """
        pause = self.pause_c if pause_c is None else pause_c
        if resume_c is not None:
            return Thresholds(pause, resume_c)
        resume = self.resume_c
        if resume > pause:
            resume = pause - (self.pause_c - self.resume_c)
        return Thresholds(pause, resume)


# Defaults per vendor, every one overridable in config (thermal.*_pause_c / *_resume_c).
# - cpu: Intel parts throttle at TjMax ≈ 100 °C; pausing at 90 keeps headroom. (Some AMD Ryzen
#   7000 parts sit at their 95 °C target under full load by design: raise cpu_pause_c there.)
# - nvidia: `nvidia-smi -q` typically shows a target temperature of ~83 °C and a "GPU Slowdown
#   Temp" of ~90 °C (clocks halve there); pause at 87 just before slowdown, resume at 80 below
#   the target so the fan curve has caught up.
# - amd: amdgpu's edge sensor runs hotter in normal operation (junction limit ~110 °C); 95/85
#   on the edge reading leaves the same kind of margin.
DEFAULT_THRESHOLDS: dict[str, Thresholds] = {
    "cpu": Thresholds(pause_c=90.0, resume_c=80.0),
    "nvidia": Thresholds(pause_c=87.0, resume_c=80.0),
    "amd": Thresholds(pause_c=95.0, resume_c=85.0),
}


def _deg(value: float) -> str:
    return f"{value:g} °C"


def _hot(was_paused: bool, what: str, temp_c: float | None, limits: Thresholds) -> str | None:
    """Why `what` keeps (or puts) the engine paused, or None when it does not."""
    if temp_c is None or math.isnan(temp_c):
        return None
    if temp_c >= limits.pause_c:
        return f"{what} at {_deg(temp_c)} ≥ {_deg(limits.pause_c)}"
    if was_paused and temp_c >= limits.resume_c:
        return f"{what} at {_deg(temp_c)}, paused until < {_deg(limits.resume_c)}"
    return None


def engine_paused(
    was_paused: bool,
    cpu_c: float | None,
    gpu_c: float | None,
    cpu: Thresholds,
    gpu: Thresholds,
    *,
    gpu_index: int | None = None,
) -> tuple[bool, str | None]:
    """Should this engine be paused now, and why (for /status and the log)?

    Every engine evaluates the shared CPU reading, so a hot CPU pauses them all; `gpu_c` is this
    engine's own GPU, so a hot GPU pauses only its engine. `was_paused` is the previous answer:
    while paused, a reading in its hysteresis band [resume_c, pause_c) keeps the pause, so the
    engine resumes only when every known reading is below its resume point. Several reasons are
    joined with "; ". `gpu_index` only names the GPU in the reason.
    """
    gpu_name = "gpu" if gpu_index is None else f"gpu {gpu_index}"
    reasons = [
        r
        for r in (_hot(was_paused, "cpu", cpu_c, cpu), _hot(was_paused, gpu_name, gpu_c, gpu))
        if r is not None
    ]
    if not reasons:
        return False, None
    return True, "; ".join(reasons)


def read_simulated_sensors(path: str | os.PathLike[str]) -> dict[str, float]:
    """A JSON object like {"cpu": 95, "gpu0": 70} → its numeric entries; {} when unreadable.

    A missing file, invalid JSON or a non-object reads as "no sensors"; entries that are not
    finite numbers are skipped. The file is re-read on every call, so a test (or an operator
    rehearsing a heat wave) can change temperatures while the server runs.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError covers JSONDecodeError and bad UTF-8
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        str(key): float(value)
        for key, value in data.items()
        if isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


GpuReader = Callable[[int], float | None]
CpuReader = Callable[[], float | None]


class ThermalSensors:
    """Current CPU and GPU temperatures, from the simulated file when one is configured.

    With `simulated_path`, only that file is read ("cpu", "gpu<index>"; a missing key is an
    unknown temperature, never a fall back to real sensors, so simulated runs are reproducible).
    Otherwise the CPU comes from `cpu_reader` (psutil by default) and a GPU from `gpu_reader`,
    e.g. `NvmlProbe().temperature_c` or a lookup in nvidia-smi's answer; no reader: None.
    """

    def __init__(
        self,
        simulated_path: str | os.PathLike[str] | None = None,
        gpu_reader: GpuReader | None = None,
        cpu_reader: CpuReader = cpu_temperature_c,
    ) -> None:
        self.simulated_path = None if simulated_path is None else Path(simulated_path)
        self._gpu_reader = gpu_reader
        self._cpu_reader = cpu_reader

    def _simulated(self) -> Mapping[str, float] | None:
        if self.simulated_path is None:
            return None
        return read_simulated_sensors(self.simulated_path)

    def cpu_c(self) -> float | None:
        simulated = self._simulated()
        if simulated is not None:
            return simulated.get("cpu")
        return self._cpu_reader()

    def gpu_c(self, index: int) -> float | None:
        simulated = self._simulated()
        if simulated is not None:
            return simulated.get(f"gpu{index}")
        if self._gpu_reader is None:
            return None
        return self._gpu_reader(index)
