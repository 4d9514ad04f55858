"""engine.ledger: planning memory, waiting for a dead process's memory, and the device seams."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from tests.support import sleeper

from modelyard.engine.ledger import (
    HostDevice,
    Loading,
    SimulatedDevice,
    plannable_free,
    wait_for_recovery,
)
from modelyard.hw.gpu_probe import GpuDevice
from modelyard.hw.simulated import CLAIMS_DIR_ENV, SimulatedGpu
from modelyard.types import DeviceInfo

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

MiB, GiB = 2**20, 2**30
TOTAL = 8 * GiB


def L(reserved_gib: float, measured_gib: float = 0) -> Loading:
    return Loading(int(reserved_gib * GiB), int(measured_gib * GiB))


@pytest.mark.parametrize(
    ("free_gib", "loading", "expected_gib"),
    [
        pytest.param(6, [], 6, id="nothing-loading"),
        pytest.param(6, [L(4)], 2, id="loading-not-yet-measured"),
        pytest.param(6, [L(4, 1)], 3, id="partly-measured"),
        pytest.param(6, [L(4, 4)], 6, id="fully-measured"),
        pytest.param(6, [L(4, 5)], 6, id="measured-above-reserved-adds-nothing"),
        pytest.param(6, [L(4, 5), L(2)], 4, id="overshoot-does-not-offset-another-load"),
        pytest.param(6, [L(3, 1), L(2)], 2, id="two-loads"),
        pytest.param(2, [L(4)], 0, id="never-negative"),
        pytest.param(0, [L(1), L(1)], 0, id="never-negative-with-nothing-free"),
    ],
)
def test_plannable_free(free_gib: float, loading: list[Loading], expected_gib: float) -> None:
    assert plannable_free(int(free_gib * GiB), loading) == int(expected_gib * GiB)


def test_plannable_free_takes_any_iterable() -> None:
    assert plannable_free(6 * GiB, (ld for ld in [L(1), L(2)])) == 3 * GiB


# --- wait_for_recovery over a simulated device and real processes ----------------------------


@pytest.fixture
def device(tmp_path: Path) -> SimulatedDevice:
    return SimulatedDevice(SimulatedGpu(0, TOTAL, tmp_path / "claims"))


async def test_recovery_returns_true_once_the_process_dies(
    device: SimulatedDevice, proc: subprocess.Popen[bytes]
) -> None:
    device.on_spawn(proc.pid, 6 * GiB)
    assert device.info().free_bytes == 2 * GiB
    killed = asyncio.Event()

    def kill() -> None:
        proc.kill()  # not reaped: a zombie has freed its memory too
        killed.set()

    asyncio.get_running_loop().call_later(0.1, kill)
    start = time.monotonic()
    ok = await wait_for_recovery(device, {proc.pid}, 8 * GiB, timeout_s=10, poll_s=0.01)
    elapsed = time.monotonic() - start
    assert ok is True
    assert killed.is_set()  # it did not return while the process lived
    assert elapsed < 3, f"took {elapsed:.2f} s after the kill to see the memory back"
    assert device.info().free_bytes == TOTAL


async def test_recovery_times_out_while_the_process_lives(
    device: SimulatedDevice, proc: subprocess.Popen[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    device.on_spawn(proc.pid, 6 * GiB)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="modelyard.engine.ledger"):
        ok = await wait_for_recovery(device, {proc.pid}, 4 * GiB, timeout_s=0.2, poll_s=0.01)
    elapsed = time.monotonic() - start
    assert ok is False
    assert 0.2 <= elapsed < 3
    assert proc.poll() is None
    assert any(
        "memory not back" in r.getMessage() and str(proc.pid) in r.getMessage()
        for r in caplog.records
    )


async def test_recovery_also_waits_for_the_bytes_wanted(
    device: SimulatedDevice, proc: subprocess.Popen[bytes]
) -> None:
    """The gone pid is gone, but another live process still holds what the load needs."""
    other = sleeper()
    try:
        device.on_spawn(other.pid, 5 * GiB)
        proc.kill()
        proc.wait()
        assert await wait_for_recovery(device, {proc.pid}, 3 * GiB, timeout_s=5) is True
        ok = await wait_for_recovery(device, {proc.pid}, 4 * GiB, timeout_s=0.2, poll_s=0.01)
        assert ok is False
    finally:
        other.kill()
        other.wait()
    assert await wait_for_recovery(device, {proc.pid}, 4 * GiB, timeout_s=5) is True


async def test_recovery_is_immediate_when_nothing_is_held(device: SimulatedDevice) -> None:
    # a clock that never advances: only an immediate answer can return at all
    ok = await wait_for_recovery(device, set(), TOTAL, timeout_s=0, clock=lambda: 0.0)
    assert ok is True


# --- SimulatedDevice --------------------------------------------------------------------------


def test_simulated_device_starts_empty_and_names_its_claims_dir(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    claims.mkdir()
    (claims / str(os.getpid())).write_text(str(GiB))  # stale, from a previous engine
    device = SimulatedDevice(SimulatedGpu(0, TOTAL, claims), temperature_c=lambda: 55)
    info = device.info()
    assert (info.free_bytes, info.temperature_c, device.kind) == (TOTAL, 55, "simulated")
    assert device.child_env() == {CLAIMS_DIR_ENV: str(claims), "CUDA_VISIBLE_DEVICES": ""}


def test_simulated_device_used_by_reports_only_the_pids_asked(
    device: SimulatedDevice, proc: subprocess.Popen[bytes]
) -> None:
    device.on_spawn(proc.pid, 2 * GiB)
    device.on_spawn(os.getpid(), 1 * GiB)
    assert device.used_by([proc.pid]) == {proc.pid: 2 * GiB}
    assert device.used_by([proc.pid, os.getpid(), 999_999_999]) == {
        proc.pid: 2 * GiB, os.getpid(): 1 * GiB
    }


def test_a_child_on_the_child_env_claims_for_itself(device: SimulatedDevice) -> None:
    code = (
        "import os, sys, time\n"
        "from modelyard.hw.simulated import file_claim\n"
        "file_claim(1234)\n"
        "sys.stdout.write(repr(os.environ['CUDA_VISIBLE_DEVICES']) + '\\n'); sys.stdout.flush()\n"
        "time.sleep(30)\n"
    )
    # `with`: leaving it closes the pipe and waits (an open pipe is a ResourceWarning)
    with subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, **device.child_env()},
        stdout=subprocess.PIPE,
    ) as child:
        try:
            device.on_spawn(child.pid, 4 * GiB)  # the engine's stand-in for it
            assert child.stdout is not None
            assert child.stdout.readline() == b"''\n"  # it sees no GPU
            assert device.used_by([child.pid]) == {child.pid: 1234}  # its own claim wins
        finally:
            child.kill()
    assert device.used_by([child.pid]) == {}


# --- HostDevice -------------------------------------------------------------------------------


def test_host_device_cap_caps_total_and_free() -> None:
    cap = 64 * MiB
    assert psutil.virtual_memory().total > 16 * cap
    info = HostDevice(cap, lambda: []).info()
    assert info.kind == "cpu"
    assert info.total_bytes == cap
    assert info.free_bytes is not None and 0 <= info.free_bytes <= cap
    assert info.used_bytes == cap - info.free_bytes


def test_host_device_cap_counts_what_its_children_hold(
    proc: subprocess.Popen[bytes],
) -> None:
    cap = 1 * GiB
    held = HostDevice(None, lambda: []).used_by([proc.pid])[proc.pid]
    info = HostDevice(cap, lambda: [proc.pid]).info()
    assert info.total_bytes == cap
    assert info.free_bytes is not None
    # the child's resident memory is taken off the cap (RSS moves a little between reads)
    assert info.free_bytes <= cap - held // 2


def test_host_device_without_a_cap_is_the_whole_machine() -> None:
    info = HostDevice(None, lambda: []).info()
    assert info.total_bytes == psutil.virtual_memory().total


def test_host_device_used_by_live_and_dead(proc: subprocess.Popen[bytes]) -> None:
    device = HostDevice(None, lambda: [])
    used = device.used_by([proc.pid])
    assert set(used) == {proc.pid}
    assert used[proc.pid] > 1 * MiB  # a Python interpreter's resident memory
    dead = sleeper()
    dead.kill()
    dead.wait()
    assert device.used_by([dead.pid]) == {}
    assert set(device.used_by([proc.pid, dead.pid])) == {proc.pid}
    assert device.child_env() == {}


# --- GpuDevice --------------------------------------------------------------------------------


def _gpu_info(free: int) -> DeviceInfo:
    return DeviceInfo(0, "GPU-x", "test gpu", TOTAL, TOTAL - free, free, 10, 50)


def test_gpu_device_keeps_the_last_good_reading() -> None:
    readings: list[DeviceInfo | None] = [None, _gpu_info(3 * GiB), None, None, _gpu_info(5 * GiB)]
    device = GpuDevice(lambda: readings.pop(0), lambda: {}, fallback_total_bytes=TOTAL)
    first = device.info()  # unreadable before any good reading: total known, free unknown
    assert (first.total_bytes, first.free_bytes, first.used_bytes) == (TOTAL, None, None)
    assert device.info().free_bytes == 3 * GiB
    assert device.info().free_bytes == 3 * GiB  # driver silent: the last reading
    assert device.info().free_bytes == 3 * GiB
    assert device.info().free_bytes == 5 * GiB
    assert readings == []


def test_gpu_device_used_by_filters_the_process_list() -> None:
    device = GpuDevice(lambda: _gpu_info(TOTAL), lambda: {10: GiB, 11: 2 * GiB})
    assert device.used_by([11, 12]) == {11: 2 * GiB}
    assert device.child_env() == {}
