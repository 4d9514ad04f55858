"""hw.smi: the parser on captured nvidia-smi output, the runner with an injected `run`."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from modelyard.hw.smi import NVIDIA_SMI_ARGS, QUERY_GPU_FIELDS, parse_query_gpu_csv, query_gpus
from modelyard.types import DeviceInfo

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

DATA = Path(__file__).resolve().parents[1] / "data" / "smi"
MIB = 1024 * 1024


def captured(name: str) -> str:
    return (DATA / name).read_text()


def test_query_fields_match_the_columns_we_parse() -> None:
    assert QUERY_GPU_FIELDS == (
        "index",
        "uuid",
        "name",
        "memory.total",
        "memory.used",
        "memory.free",
        "utilization.gpu",
        "temperature.gpu",
    )
    assert NVIDIA_SMI_ARGS[1] == "--query-gpu=" + ",".join(QUERY_GPU_FIELDS)
    assert NVIDIA_SMI_ARGS[2] == "--format=csv,noheader,nounits"


def test_two_gpus() -> None:
    devices = parse_query_gpu_csv(captured("two_gpus.csv"))
    assert devices == [
        DeviceInfo(
            index=0,
            uuid="GPU-5e3c1a2b-7f4d-2c9e-8b1a-3d6f9e0c4a57",
            name="NVIDIA GeForce RTX 4090",
            total_bytes=24564 * MIB,
            used_bytes=1234 * MIB,
            free_bytes=23000 * MIB,
            utilization_pct=7,
            temperature_c=45,
        ),
        DeviceInfo(
            index=1,
            uuid="GPU-a81f6c03-94b2-4e1d-b7c5-02e9d8f3a61c",
            name="NVIDIA GeForce RTX 3090",
            total_bytes=24576 * MIB,
            used_bytes=18342 * MIB,
            free_bytes=5940 * MIB,
            utilization_pct=98,
            temperature_c=71,
        ),
    ]
    assert all(d.kind == "cuda" for d in devices)


def test_mig_gpu_has_unknown_utilization() -> None:
    mig, plain = parse_query_gpu_csv(captured("mig.csv"))
    assert mig.name == "NVIDIA A100-SXM4-80GB"
    assert mig.utilization_pct is None
    assert (mig.total_bytes, mig.free_bytes, mig.temperature_c) == (81920 * MIB, 67948 * MIB, 34)
    assert plain.utilization_pct == 0


def test_not_supported_temperature() -> None:
    (t4,) = parse_query_gpu_csv(captured("temp_not_supported.csv"))
    assert t4.name == "Tesla T4"
    assert t4.temperature_c is None
    assert t4.used_bytes == 0


def test_empty_output() -> None:
    assert captured("empty.csv") == ""
    assert parse_query_gpu_csv(captured("empty.csv")) == []
    assert parse_query_gpu_csv("\n  \n") == []


def test_odd_spacing_null_spellings_and_junk_lines() -> None:
    text = (
        "\n"
        "  1 ,GPU-b,  Tesla   V100 ,16160,N/A,[N/A],  [Unknown Error] , 40  \r\n"
        "No devices were found\n"
        "0, [N/A], NVIDIA H100 80GB HBM3, 81559, [Insufficient Permissions], 80000, 3, 29\n"
        "2, GPU-lost, NVIDIA L4, [GPU is lost], 0, 0, 0, 0\n"
    )
    h100, v100 = parse_query_gpu_csv(text)  # ordered by index; the lost GPU is dropped
    assert (h100.index, h100.uuid, h100.used_bytes, h100.free_bytes) == (0, None, None, 80000 * MIB)
    assert (v100.index, v100.uuid, v100.name) == (1, "GPU-b", "Tesla   V100")
    assert (v100.used_bytes, v100.free_bytes, v100.utilization_pct) == (None, None, None)
    assert v100.temperature_c == 40


def test_a_comma_in_the_name_is_kept() -> None:
    (dev,) = parse_query_gpu_csv("0, GPU-x, Custom GPU, Rev 2, 1024, 0, 1024, 0, 30\n")
    assert dev.name == "Custom GPU, Rev 2"
    assert dev.total_bytes == 1024 * MIB


class FakeRun:
    """Stands in for subprocess.run: records the call, then answers or raises."""

    def __init__(self, stdout: str = "", returncode: int = 0, exc: Exception | None = None):
        self.stdout, self.returncode, self.exc = stdout, returncode, exc
        self.calls: list[tuple[list[str], dict[str, Any]]] = []

    def __call__(self, args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append((args, kwargs))
        if self.exc is not None:
            raise self.exc
        return subprocess.CompletedProcess(args, self.returncode, self.stdout, "")


def test_query_gpus_parses_captured_output() -> None:
    run = FakeRun(stdout=captured("two_gpus.csv"))
    devices = query_gpus(run=run, timeout_s=2.5)
    assert [d.name for d in devices] == ["NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 3090"]
    ((args, kwargs),) = run.calls
    assert args == list(NVIDIA_SMI_ARGS)
    assert kwargs["timeout"] == 2.5
    assert kwargs["capture_output"] is True and kwargs["text"] is True


@pytest.mark.parametrize(
    "run",
    [
        FakeRun(exc=FileNotFoundError(2, "No such file or directory", "nvidia-smi")),
        FakeRun(exc=PermissionError(13, "Permission denied")),
        FakeRun(exc=subprocess.TimeoutExpired(["nvidia-smi"], 5.0)),
        FakeRun(
            stdout="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
            "driver. Make sure that the latest NVIDIA driver is installed and running.\n",
            returncode=9,
        ),
        FakeRun(stdout=captured("two_gpus.csv"), returncode=1),
        FakeRun(stdout=""),
    ],
    ids=["absent", "not-executable", "timeout", "driver-failure", "nonzero", "no-output"],
)
def test_query_gpus_never_raises(run: FakeRun) -> None:
    assert query_gpus(run=run) == []
    assert len(run.calls) == 1
