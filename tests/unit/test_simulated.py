"""hw.simulated: size parsers as tables; a simulated GPU counts only live processes' claims."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.support import sleeper

from modelyard.hw.simulated import (
    CLAIMS_DIR_ENV,
    SimulatedGpu,
    file_claim,
    parse_simulated_gpus,
    parse_size,
    pid_alive,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
TOTAL = 8 * GiB


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * GiB),
        ("512MiB", 512 * MiB),
        ("8gb", 8 * 10**9),  # decimal units
        ("100kb", 100 * 10**3),
        ("2TiB", 2 * TiB),
        ("4KiB", 4 * KiB),
        ("1024", 1024),  # a plain byte count
        ("1024b", 1024),
        ("1.5GiB", 3 * GiB // 2),
        ("  24 gib  ", 24 * GiB),  # case and spaces do not matter
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "24XiB", "-1GiB", "abc", "1e3", "24 Gi B", "1,5GiB"])
def test_parse_size_rejects_with_an_example(text: str) -> None:
    with pytest.raises(ValueError, match=r"not a size: .*e\.g\. 24GiB") as err:
        parse_size(text)
    assert repr(text) in str(err.value)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("2x24GiB", [24 * GiB, 24 * GiB]),
        ("24GiB,8GiB", [24 * GiB, 8 * GiB]),
        ("1x8GiB", [8 * GiB]),
        ("512MiB", [512 * MiB]),
        ("8gb", [8 * 10**9]),
        ("2x8GiB,1x4GiB", [8 * GiB, 8 * GiB, 4 * GiB]),
        (" 2 x 24GiB ", [24 * GiB, 24 * GiB]),
    ],
)
def test_parse_simulated_gpus(spec: str, expected: list[int]) -> None:
    assert parse_simulated_gpus(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", r"not a size: ''"),
        ("lots", r"not a size: 'lots' \(e\.g\. 24GiB"),
        ("2x", r"not a size: ''"),
        ("x24GiB", r"not a size: 'x24GiB'"),
        ("twox24GiB", r"not a size: 'twox24GiB'"),
        ("2x24XiB", r"not a size: '24XiB'"),
        ("24GiB,", r"not a size: ''"),
        ("0x24GiB", r"simulate_gpus: no device in '0x24GiB'"),
        ("0GiB", r"simulate_gpus: no device in '0GiB'"),
        ("8GiB,1x0GiB", r"simulate_gpus: no device in '8GiB,1x0GiB'"),
    ],
)
def test_parse_simulated_gpus_rejects(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_simulated_gpus(spec)


# --- SimulatedGpu over real processes -------------------------------------------------------


@pytest.fixture
def gpu(tmp_path: Path) -> SimulatedGpu:
    g = SimulatedGpu(0, TOTAL, tmp_path / "claims")
    g.reset()
    return g


def _proc_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_live_claim_counts_and_dead_claim_does_not(
    gpu: SimulatedGpu, proc: subprocess.Popen[bytes]
) -> None:
    (gpu.claims_dir / str(proc.pid)).write_text(str(3 * GiB))
    assert gpu.used_by_pid() == {proc.pid: 3 * GiB}
    info = gpu.info()
    assert (info.total_bytes, info.used_bytes, info.free_bytes) == (TOTAL, 3 * GiB, 5 * GiB)
    assert info.kind == "simulated"

    proc.kill()
    proc.wait()
    assert not pid_alive(proc.pid)
    assert gpu.used_by_pid() == {}
    info = gpu.info()
    assert (info.used_bytes, info.free_bytes) == (0, TOTAL)
    # the claim file is still there: only the process's death frees the memory
    assert (gpu.claims_dir / str(proc.pid)).exists()


def test_zombie_counts_as_gone(gpu: SimulatedGpu, proc: subprocess.Popen[bytes]) -> None:
    (gpu.claims_dir / str(proc.pid)).write_text(str(2 * GiB))
    assert gpu.info().used_bytes == 2 * GiB

    proc.kill()  # no wait(): the process stays a zombie until it is reaped
    deadline = time.monotonic() + 10
    while proc.pid in gpu.used_by_pid():
        assert time.monotonic() < deadline, "a killed process's claim still counts after 10 s"
        time.sleep(0.01)  # polling the device
    assert _proc_state(proc.pid) == "Z"  # still in the process table, unreaped
    assert gpu.info().free_bytes == TOTAL


def test_pid_alive() -> None:
    assert pid_alive(os.getpid())
    p = sleeper()
    p.kill()
    p.wait()
    assert not pid_alive(p.pid)


def test_own_claim_wins_over_stand_in(gpu: SimulatedGpu, proc: subprocess.Popen[bytes]) -> None:
    gpu.claim_stand_in(proc.pid, 4 * GiB)
    assert gpu.used_by_pid() == {proc.pid: 4 * GiB}  # the stand-in alone counts
    (gpu.claims_dir / str(proc.pid)).write_text(str(1 * GiB))
    assert gpu.used_by_pid() == {proc.pid: 1 * GiB}  # the process's own claim replaces it
    assert gpu.info().used_bytes == 1 * GiB


def test_claims_of_several_processes_add_up_and_are_capped_at_total(
    gpu: SimulatedGpu, proc: subprocess.Popen[bytes]
) -> None:
    (gpu.claims_dir / str(proc.pid)).write_text(str(3 * GiB))
    gpu.claim_stand_in(os.getpid(), 2 * GiB)
    assert gpu.info().used_bytes == 5 * GiB
    gpu.claim_stand_in(os.getpid(), 20 * GiB)
    info = gpu.info()
    assert (info.used_bytes, info.free_bytes) == (TOTAL, 0)


def test_unreadable_and_foreign_files_are_ignored(
    gpu: SimulatedGpu, proc: subprocess.Popen[bytes]
) -> None:
    (gpu.claims_dir / str(proc.pid)).write_text(str(1 * GiB))
    (gpu.claims_dir / f"tmp-{proc.pid}").write_text(str(5 * GiB))  # a claim being written
    (gpu.claims_dir / str(os.getpid())).write_text("half a numb")
    (gpu.claims_dir / "notes.txt").write_text("7")
    assert gpu.used_by_pid() == {proc.pid: 1 * GiB}


def test_missing_claims_dir_means_empty_device(tmp_path: Path) -> None:
    g = SimulatedGpu(1, TOTAL, tmp_path / "never-created")
    assert g.used_by_pid() == {}
    info = g.info(temperature_c=41)
    assert (info.index, info.uuid, info.free_bytes, info.temperature_c) == (
        1, "SIM-GPU-1", TOTAL, 41
    )


def test_reset_clears_every_claim(gpu: SimulatedGpu, proc: subprocess.Popen[bytes]) -> None:
    (gpu.claims_dir / str(proc.pid)).write_text(str(1 * GiB))
    gpu.claim_stand_in(proc.pid, 2 * GiB)
    gpu.claim_stand_in(os.getpid(), 2 * GiB)
    assert gpu.info().used_bytes == 3 * GiB
    gpu.reset()
    assert list(gpu.claims_dir.iterdir()) == []
    assert gpu.info().used_bytes == 0


# --- file_claim -------------------------------------------------------------------------------


def test_file_claim_under_an_explicit_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CLAIMS_DIR_ENV, str(tmp_path / "from-env"))
    where = tmp_path / "explicit" / "gpu0"  # created on demand
    path = file_claim(3 * MiB, str(where))
    assert path == where / str(os.getpid())
    assert path.read_text() == str(3 * MiB)
    assert [f.name for f in where.iterdir()] == [str(os.getpid())]  # no temp file left behind
    assert not (tmp_path / "from-env").exists()  # the explicit dir wins over the environment
    # a second claim replaces the first in place
    assert file_claim(5 * MiB, str(where)) == path
    assert path.read_text() == str(5 * MiB)
    assert [f.name for f in where.iterdir()] == [str(os.getpid())]
    # and a simulated GPU over that dir counts it: this process is alive
    assert SimulatedGpu(0, TOTAL, where).used_by_pid() == {os.getpid(): 5 * MiB}


def test_file_claim_under_the_env_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    where = tmp_path / "env-claims"
    monkeypatch.setenv(CLAIMS_DIR_ENV, str(where))
    path = file_claim(7 * MiB)
    assert path == where / str(os.getpid())
    assert path.read_text() == str(7 * MiB)
    assert [f.name for f in where.iterdir()] == [str(os.getpid())]


def test_file_claim_without_a_simulated_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CLAIMS_DIR_ENV, raising=False)
    assert file_claim(1 * MiB) is None
    monkeypatch.setenv(CLAIMS_DIR_ENV, "")
    assert file_claim(1 * MiB) is None


def test_a_child_files_its_own_claim_through_the_env(
    gpu: SimulatedGpu, tmp_path: Path
) -> None:
    code = (
        "import sys, time\n"
        "from modelyard.hw.simulated import file_claim\n"
        "file_claim(123456)\n"
        "sys.stdout.write('claimed\\n'); sys.stdout.flush()\n"
        "time.sleep(30)\n"
    )
    env = {**os.environ, CLAIMS_DIR_ENV: str(gpu.claims_dir)}
    # `with`: leaving it closes the pipe and waits (an open pipe is a ResourceWarning)
    with subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == b"claimed\n"
            assert gpu.used_by_pid() == {child.pid: 123456}
        finally:
            child.kill()
    assert gpu.used_by_pid() == {}
