"""hw.host: the CPU temperature picker on captured-style sensor dicts, and the psutil wrappers."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import psutil
import pytest

from modelyard.hw import host
from modelyard.hw.host import cpu_percent, cpu_temperature_c, host_memory

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

try:  # psutil >= 7 keeps its namedtuples in _ntuples, older releases in _common
    from psutil._ntuples import shwtemp
except ImportError:  # pragma: no cover - depends on the installed psutil
    shwtemp = namedtuple("shwtemp", "label current high critical")  # type: ignore[misc]


def t(label: str, current: float, high: float | None = None, critical: float | None = None) -> Any:
    return shwtemp(label, current, high, critical)


# Shaped like psutil.sensors_temperatures() on real hosts.
INTEL_DESKTOP = {
    "acpitz": [t("", 27.8, 105.0, 105.0)],
    "coretemp": [
        t("Package id 0", 71.0, 80.0, 100.0),
        t("Core 0", 66.0, 80.0, 100.0),
        t("Core 1", 74.0, 80.0, 100.0),
        t("Core 2", 69.0, 80.0, 100.0),
    ],
    "nvme": [t("Composite", 41.85, 84.85, 84.85)],
    "iwlwifi_1": [t("", 44.0)],
}
AMD_RYZEN = {
    "amdgpu": [t("edge", 51.0, None, None), t("junction", 58.0, 110.0, 110.0)],
    "k10temp": [t("Tctl", 62.5), t("Tccd1", 58.25), t("Tccd2", 60.0)],
    "nvme": [t("Composite", 38.85, 79.85, 84.85)],
}
ZENPOWER = {"zenpower": [t("Tdie", 55.0), t("Tctl", 55.0), t("Tccd1", 57.5)]}
RASPBERRY_PI = {"cpu_thermal": [t("", 48.686)]}
ACPI_ONLY = {"acpitz": [t("", 40.0, 95.0, 95.0), t("", 52.0, 95.0, 95.0)]}


@pytest.mark.parametrize(
    ("sensors", "expected"),
    [
        (INTEL_DESKTOP, 74.0),  # hottest core; acpitz, NVMe and Wi-Fi are not the CPU
        (AMD_RYZEN, 62.5),  # the GPU's junction is hotter but belongs to the GPU
        (ZENPOWER, 57.5),
        (RASPBERRY_PI, 48.686),
        ({"cpu-thermal": [t("", 61.0)]}, 61.0),
        ({"x86_pkg_temp": [t("", 58.0)]}, 58.0),
        (ACPI_ONLY, 52.0),  # fallback when no CPU sensor exists
        ({"acpitz": [t("", 99.0)], "coretemp": [t("Core 0", 50.0)]}, 50.0),  # CPU sensor wins
        ({"coretemp": [], "acpitz": [t("", 45.0)]}, 45.0),  # an empty CPU entry falls back
        ({}, None),
        ({"nvme": [t("Composite", 40.0)], "amdgpu": [t("edge", 50.0)]}, None),
    ],
    ids=["intel", "ryzen", "zenpower", "rpi", "cpu-thermal", "x86_pkg_temp", "acpi-only",
         "cpu-beats-acpi", "empty-cpu-entry", "no-sensors", "no-cpu-sensor"],
)
def test_cpu_temperature(sensors: dict[str, list[Any]], expected: float | None) -> None:
    assert cpu_temperature_c(sensors) == expected


@pytest.mark.parametrize(
    "bogus",
    [0.0, -273.0, 255.0, float("nan"), float("inf"), float("-inf")],
)
def test_implausible_readings_are_ignored(bogus: float) -> None:
    assert cpu_temperature_c({"coretemp": [t("Core 0", bogus), t("Core 1", 63.0)]}) == 63.0
    assert cpu_temperature_c({"coretemp": [t("Core 0", bogus)]}) is None


def test_reads_psutil_when_no_dict_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(psutil, "sensors_temperatures", lambda: AMD_RYZEN, raising=False)
    assert cpu_temperature_c() == 62.5


def test_platform_without_sensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(psutil, "sensors_temperatures", raising=False)  # macOS, Windows
    assert cpu_temperature_c() is None


def test_sensor_read_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> dict[str, list[Any]]:
        raise OSError("hwmon vanished")

    monkeypatch.setattr(psutil, "sensors_temperatures", broken, raising=False)
    assert cpu_temperature_c() is None


def test_this_host_reading_is_none_or_plausible() -> None:
    reading = cpu_temperature_c()
    assert reading is None or 0 < reading <= 150


def test_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    total, available = host_memory()
    assert 0 < available <= total
    vmem = namedtuple("vmem", "total available percent used free")
    fake = vmem(64 * 2**30, 40 * 2**30, 37.5, 20 * 2**30, 10 * 2**30)
    monkeypatch.setattr(host.psutil, "virtual_memory", lambda: fake)
    assert host_memory() == (64 * 2**30, 40 * 2**30)


def test_cpu_percent() -> None:
    cpu_percent()  # primes psutil's sample (the first call is always 0.0)
    value = cpu_percent()
    assert isinstance(value, float)
    assert 0.0 <= value <= 100.0
