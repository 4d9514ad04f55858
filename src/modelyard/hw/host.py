"""Host probe through psutil: RAM, CPU load and CPU temperature.

The CPU engine places models in host RAM, and thermal protection pauses every engine when the CPU
runs hot, so both need these figures; psutil is a base dependency and light enough for the front.
The temperature picker is pure over a `sensors_temperatures()`-shaped dict, so it is tested on
captured readings instead of this machine's (often absent) sensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import psutil

# hwmon / thermal-zone names that measure the CPU package or its dies:
# Intel (coretemp, x86_pkg_temp), AMD (k10temp, or the out-of-tree zenpower), ARM boards such as
# the Raspberry Pi (cpu_thermal; some kernels spell it cpu-thermal).
CPU_SENSORS: tuple[str, ...] = (
    "coretemp",
    "k10temp",
    "zenpower",
    "cpu_thermal",
    "cpu-thermal",
    "x86_pkg_temp",
)
# ACPI thermal zones are motherboard-defined and often not the CPU at all: only a last resort.
FALLBACK_SENSORS: tuple[str, ...] = ("acpitz",)

# Readings outside this range are sensor faults (unwired inputs read 0, broken ones 255 or -273),
# and a bogus hot reading would pause every engine, so they are ignored.
_PLAUSIBLE_C = (0.0, 150.0)


def host_memory() -> tuple[int, int]:
    """(total, available) host RAM in bytes; "available" counts reclaimable page cache."""
    mem = psutil.virtual_memory()
    return int(mem.total), int(mem.available)


def cpu_percent() -> float:
    """CPU load in percent over all cores since the previous call (non-blocking).

    The first call in a process has no previous sample and returns 0.0 (psutil's semantics).
    """
    return float(psutil.cpu_percent(interval=None))


def _hottest(sensors: Mapping[str, Sequence[Any]], names: Sequence[str]) -> float | None:
    low, high = _PLAUSIBLE_C
    readings: list[float] = []
    for name in names:
        for entry in sensors.get(name) or ():
            current = getattr(entry, "current", None)
            if isinstance(current, int | float) and math.isfinite(current) and (
                low < current <= high
            ):
                readings.append(float(current))
    return max(readings, default=None)


def cpu_temperature_c(sensors: Mapping[str, Sequence[Any]] | None = None) -> float | None:
    """The hottest current CPU reading in °C, or None when no CPU sensor is readable.

    `sensors` is `psutil.sensors_temperatures()`'s shape (name → readings with a `current`
    field); None reads this host's. CPU sensors (CPU_SENSORS) are preferred; ACPI zones are used
    only when none of them gives a reading. Hottest wins because throttling follows the hottest
    core or die, not the average.
    """
    if sensors is None:
        sensors = _read_sensors()
    found = _hottest(sensors, CPU_SENSORS)
    return found if found is not None else _hottest(sensors, FALLBACK_SENSORS)


def _read_sensors() -> Mapping[str, Sequence[Any]]:
    # Linux and FreeBSD only; macOS and Windows builds of psutil lack the function.
    read = getattr(psutil, "sensors_temperatures", None)
    if read is None:
        return {}
    try:
        result: Mapping[str, Sequence[Any]] = read()
    except (OSError, RuntimeError, ValueError):
        return {}
    return result
