"""hw.thermal: the pause policy as a table, the simulated sensor file, the sensor class."""

from __future__ import annotations

import json
from collections import namedtuple
from pathlib import Path

import psutil
import pytest

from modelyard.hw.thermal import (
    DEFAULT_THRESHOLDS,
    ThermalSensors,
    Thresholds,
    engine_paused,
    read_simulated_sensors,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

CPU = Thresholds(pause_c=90, resume_c=80)
GPU = Thresholds(pause_c=87, resume_c=80)


@pytest.mark.parametrize(
    ("was_paused", "cpu_c", "gpu_c", "expected"),
    [
        # cool: serving stays serving, a paused engine resumes
        (False, 60.0, 60.0, (False, None)),
        (True, 60.0, 60.0, (False, None)),
        # cpu at and above its pause point
        (False, 90.0, 60.0, (True, "cpu at 90 °C ≥ 90 °C")),
        (False, 93.0, 60.0, (True, "cpu at 93 °C ≥ 90 °C")),
        (False, 93.5, None, (True, "cpu at 93.5 °C ≥ 90 °C")),
        # cpu in its hysteresis band: no new pause, but an existing one holds
        (False, 85.0, 60.0, (False, None)),
        (True, 85.0, 60.0, (True, "cpu at 85 °C, paused until < 80 °C")),
        (True, 80.0, 60.0, (True, "cpu at 80 °C, paused until < 80 °C")),
        (True, 79.9, 60.0, (False, None)),
        # gpu at and above its pause point
        (False, 60.0, 87.0, (True, "gpu 1 at 87 °C ≥ 87 °C")),
        (False, 60.0, 89.0, (True, "gpu 1 at 89 °C ≥ 87 °C")),
        # gpu in its band
        (False, 60.0, 84.0, (False, None)),
        (True, 60.0, 84.0, (True, "gpu 1 at 84 °C, paused until < 80 °C")),
        (True, 60.0, 79.0, (False, None)),
        # both hot: both reasons
        (False, 95.0, 90.0, (True, "cpu at 95 °C ≥ 90 °C; gpu 1 at 90 °C ≥ 87 °C")),
        (True, 95.0, 82.0, (True, "cpu at 95 °C ≥ 90 °C; gpu 1 at 82 °C, paused until < 80 °C")),
        # unknown temperatures never pause, and never hold a pause
        (False, None, None, (False, None)),
        (True, None, None, (False, None)),
        (False, None, 88.0, (True, "gpu 1 at 88 °C ≥ 87 °C")),
        (True, None, 70.0, (False, None)),
        (False, float("nan"), 70.0, (False, None)),
    ],
)
def test_engine_paused(
    was_paused: bool,
    cpu_c: float | None,
    gpu_c: float | None,
    expected: tuple[bool, str | None],
) -> None:
    assert engine_paused(was_paused, cpu_c, gpu_c, CPU, GPU, gpu_index=1) == expected


def test_cpu_engine_and_unnamed_gpu() -> None:
    # The CPU engine has no GPU: it passes None and only the CPU can pause it.
    assert engine_paused(False, 91.0, None, CPU, GPU) == (True, "cpu at 91 °C ≥ 90 °C")
    assert engine_paused(False, 50.0, 88.0, CPU, GPU) == (True, "gpu at 88 °C ≥ 87 °C")


def test_hot_cpu_pauses_every_engine_hot_gpu_only_its_own() -> None:
    gpu_temps = {0: 60.0, 1: 95.0}
    by_gpu_hot = {
        i: engine_paused(False, 70.0, c, CPU, GPU, gpu_index=i)[0] for i, c in gpu_temps.items()
    }
    assert by_gpu_hot == {0: False, 1: True}
    by_cpu_hot = {
        i: engine_paused(False, 95.0, c, CPU, GPU, gpu_index=i)[0] for i, c in gpu_temps.items()
    }
    assert by_cpu_hot == {0: True, 1: True}


def test_a_warming_then_cooling_sequence_flaps_once() -> None:
    readings = [70, 85, 89, 91, 89, 85, 81, 80, 79, 85, 89]
    paused = False
    states = []
    for cpu_c in readings:
        paused, _ = engine_paused(paused, float(cpu_c), None, CPU, GPU)
        states.append(paused)
    assert states == [False, False, False, True, True, True, True, True, False, False, False]


def test_default_thresholds() -> None:
    expected = {
        "cpu": Thresholds(90, 80),
        "nvidia": Thresholds(87, 80),
        "amd": Thresholds(95, 85),
    }
    assert expected == DEFAULT_THRESHOLDS
    for limits in DEFAULT_THRESHOLDS.values():
        assert limits.resume_c < limits.pause_c


def test_inverted_thresholds_are_refused() -> None:
    with pytest.raises(ValueError, match="resume_c"):
        Thresholds(pause_c=80, resume_c=85)
    assert Thresholds(80, 80).pause_c == 80  # no band is allowed


@pytest.mark.parametrize(
    ("pause_c", "resume_c", "expected"),
    [
        (None, None, Thresholds(87, 80)),
        (92.0, None, Thresholds(92, 80)),
        (None, 75.0, Thresholds(87, 75)),
        (84.0, 70.0, Thresholds(84, 70)),
        (78.0, None, Thresholds(78, 71)),  # below the default resume: the 7 °C band is kept
    ],
)
def test_overrides(
    pause_c: float | None, resume_c: float | None, expected: Thresholds
) -> None:
    assert DEFAULT_THRESHOLDS["nvidia"].with_overrides(pause_c, resume_c) == expected


def test_override_that_inverts_the_band_is_refused() -> None:
    with pytest.raises(ValueError):
        DEFAULT_THRESHOLDS["nvidia"].with_overrides(resume_c=95.0)


# --- simulated sensors --------------------------------------------------------------------


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"cpu": 95, "gpu0": 70}', {"cpu": 95.0, "gpu0": 70.0}),
        ('{"cpu": 61.5}', {"cpu": 61.5}),
        ("{}", {}),
        ('{"cpu": "hot", "gpu0": null, "gpu1": true, "gpu2": [1], "gpu3": 40}', {"gpu3": 40.0}),
        ('{"cpu": 95', {}),  # invalid JSON
        ("[95, 70]", {}),  # not an object
        ("", {}),
        ('{"cpu": NaN, "gpu0": Infinity}', {}),  # Python's json accepts these; they are not temps
    ],
    ids=["cpu-and-gpu", "float", "empty-object", "junk-values", "invalid-json", "list",
         "empty-file", "non-finite"],
)
def test_read_simulated_sensors(tmp_path: Path, text: str, expected: dict[str, float]) -> None:
    assert read_simulated_sensors(write(tmp_path / "sensors.json", text)) == expected


def test_read_simulated_sensors_missing_or_unreadable(tmp_path: Path) -> None:
    assert read_simulated_sensors(tmp_path / "absent.json") == {}
    assert read_simulated_sensors(tmp_path) == {}  # a directory
    assert read_simulated_sensors(str(tmp_path / "absent.json")) == {}  # str paths too
    (tmp_path / "latin1.json").write_bytes(b'{"cpu": "\xff"}')
    assert read_simulated_sensors(tmp_path / "latin1.json") == {}


def test_sensors_read_the_simulated_file_each_time(tmp_path: Path) -> None:
    path = write(tmp_path / "sensors.json", json.dumps({"cpu": 95, "gpu0": 70}))
    sensors = ThermalSensors(
        simulated_path=path,
        gpu_reader=lambda i: pytest.fail("real GPU read in a simulated run"),
        cpu_reader=lambda: pytest.fail("real CPU read in a simulated run"),
    )
    assert (sensors.cpu_c(), sensors.gpu_c(0), sensors.gpu_c(1)) == (95.0, 70.0, None)
    write(path, json.dumps({"cpu": 60, "gpu1": 91}))
    assert (sensors.cpu_c(), sensors.gpu_c(0), sensors.gpu_c(1)) == (60.0, None, 91.0)
    path.unlink()
    assert (sensors.cpu_c(), sensors.gpu_c(0)) == (None, None)


def test_sensors_use_the_readers_without_a_file() -> None:
    asked: list[int] = []

    def gpu_reader(index: int) -> float | None:
        asked.append(index)
        return {0: 55.0}.get(index)

    sensors = ThermalSensors(gpu_reader=gpu_reader, cpu_reader=lambda: 48.0)
    assert sensors.cpu_c() == 48.0
    assert (sensors.gpu_c(0), sensors.gpu_c(3)) == (55.0, None)
    assert asked == [0, 3]


def test_sensors_without_a_gpu_reader() -> None:
    sensors = ThermalSensors(cpu_reader=lambda: None)
    assert (sensors.cpu_c(), sensors.gpu_c(0)) == (None, None)


def test_default_cpu_reader_is_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    Temp = namedtuple("Temp", "label current high critical")
    readings = {"coretemp": [Temp("Core 0", 74.0, 80.0, 100.0)], "acpitz": [Temp("", 99.0, 0, 0)]}
    monkeypatch.setattr(psutil, "sensors_temperatures", lambda: readings, raising=False)
    assert ThermalSensors().cpu_c() == 74.0
