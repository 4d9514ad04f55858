"""`modelyard doctor` (issue 30.3): the rules as a table (wire/doctor.py `diagnose`), the report
gathered on simulated devices with fake llama-server binaries and a fake `nvidia-smi` on PATH
(engine/doctor.py), NVML's per-process accounting over a fake NVML, and the command's output
(cli/doctor.py through typer's CliRunner)."""

from __future__ import annotations

import json
import os
import stat
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from modelyard.cli.main import app
from modelyard.config import Settings
from modelyard.engine.doctor import (
    cuda_of_version_py,
    gather,
    nvml_accounting,
    simulated_gpus,
)
from modelyard.hw.nvml import NvmlProbe
from modelyard.hw.smi import parse_driver_csv
from modelyard.types import DeviceInfo
from modelyard.wire.doctor import (
    Disk,
    DoctorReport,
    Driver,
    EngineDoctor,
    Gpu,
    Host,
    ListedDevice,
    LlamaServer,
    Nvml,
    Torch,
    Vllm,
    assemble,
    diagnose,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

GIB = 1024**3
DATA = Path(__file__).parent.parent / "data"
BUILD_CUDA = "run `MODELYARD_ACCEL=cuda make llama-server` (needs nvcc)"
HOST = Host(cpus=16, ram_total_bytes=128 * GIB, ram_available_bytes=100 * GIB)
DISKS = (Disk(what="models", path="/m", total_bytes=500 * GIB, free_bytes=300 * GIB),)
H200 = Gpu(index=0, name="NVIDIA H200", total_bytes=141 * GIB, free_bytes=140 * GIB,
           compute_capability="9.0", temperature_c=30)
CUDA0 = ListedDevice(name="CUDA0", description="NVIDIA H200", total_bytes=141 * GIB, api="cuda")
CUDA_TORCH = Torch(installed=True, version="2.13.0+cu130", cuda="13.0", cuda_available=True,
                   device_count=1)


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No built llama-server, no failed-build log from this machine's cache."""
    monkeypatch.setenv("MODELYARD_CACHE", str(tmp_path / "cache"))


def gpu_engine(**changes: Any) -> EngineDoctor:
    """An engine on a real GPU where everything works."""
    base = EngineDoctor(
        engine="engine-0", driver=Driver(version="570.124.06", source="nvml"), gpus=(H200,),
        nvml=Nvml(bindings=True, bindings_version="12.570", initialized=True,
                  per_process="works"),
        llama_server=LlamaServer(path="/b/llama-server", found=True, version="version: 1",
                                 devices=(CUDA0,)),
        torch=CUDA_TORCH, vllm=Vllm(installed=True, version="0.11"))
    return base.model_copy(update=changes)


def codes(engine: EngineDoctor, host: Host = HOST,
          disks: tuple[Disk, ...] = DISKS) -> dict[str, tuple[str, str]]:
    return {p.code: (p.severity, p.fix) for p in diagnose([engine], host, disks)}


# ---- the rules ---------------------------------------------------------------------------------


def test_a_working_gpu_machine_has_no_problem() -> None:
    assert codes(gpu_engine()) == {}


def test_a_cpu_only_llama_server_on_a_gpu_is_an_error_with_its_fix() -> None:
    cpu_build = LlamaServer(path="/b/llama-server", found=True, devices=())
    severity, fix = codes(gpu_engine(llama_server=cpu_build))["llama_server_no_gpu"]
    assert severity == "error" and fix == BUILD_CUDA
    # A user's own binary: the fix names the setting.
    mine = cpu_build.model_copy(update={"configured": True})
    _, fix = codes(gpu_engine(llama_server=mine))["llama_server_no_gpu"]
    assert "llama_server_path" in fix and BUILD_CUDA.removeprefix("run ") in fix


def test_a_gpu_build_that_failed_before_is_named_in_the_fix() -> None:
    failed = LlamaServer(path="/c/llama-server-11434.0.0-avx2/llama-server", found=True,
                         devices=(), failed_builds=("/c/llama-server-11434.0.0-cuda-sm90.failed",))
    _, fix = codes(gpu_engine(llama_server=failed))["llama_server_no_gpu"]
    assert fix == ("a GPU build failed before: read /c/llama-server-11434.0.0-cuda-sm90.failed, "
                   "fix what it says, delete it, then " + BUILD_CUDA)


def test_a_listing_llama_server_could_not_give_is_unknown_not_no_gpu() -> None:
    unknown = LlamaServer(path="/b/llama-server", found=True, devices=None)
    found = codes(gpu_engine(llama_server=unknown))
    assert "llama_server_no_gpu" not in found
    assert found["llama_server_devices_unknown"][0] == "warning"


def test_a_vulkan_build_reaches_the_gpu() -> None:
    vulkan = ListedDevice(name="Vulkan0", description="NVIDIA H200", total_bytes=1, api="vulkan")
    ls = LlamaServer(path="/b/llama-server", found=True, devices=(vulkan,))
    assert codes(gpu_engine(llama_server=ls)) == {}


def test_no_llama_server_at_all() -> None:
    assert codes(gpu_engine(llama_server=LlamaServer()))["llama_server_missing"][1] == (
        "run `make llama-server`, or set `llama_server_path` to a build")


@pytest.mark.parametrize(("torch", "code", "severity", "fix"), [
    (Torch(installed=True, version="2.13.0+cpu"), "torch_cpu_build", "error",
     "reinstall with `make install`"),
    (CUDA_TORCH.model_copy(update={"cuda_available": False}), "torch_cuda_unavailable", "error",
     "update the NVIDIA driver to one for CUDA 13.0, or reinstall torch with `make install`"),
    (Torch(installed=True, version="2.13.0", error="ImportError: libcudart.so"), "torch_broken",
     "warning", "reinstall with `make install`"),
    (Torch(), "torch_missing", "info", "pip install 'modelyard[transformers]'"),
])
def test_torch_rules(torch: Torch, code: str, severity: str, fix: str) -> None:
    assert codes(gpu_engine(torch=torch)) == {code: (severity, fix)}


@pytest.mark.parametrize(("nvml", "code", "severity"), [
    (Nvml(), "nvml_missing", "warning"),
    (Nvml(bindings=True, detail="nvmlInit failed"), "nvml_unavailable", "error"),
    (Nvml(bindings=True, initialized=True, per_process="empty"), "nvml_per_process_empty",
     "warning"),
    (Nvml(bindings=True, initialized=True, per_process="foreign"), "nvml_per_process_foreign",
     "warning"),
    (Nvml(bindings=True, initialized=True, per_process="idle"), None, None),
])
def test_nvml_rules(nvml: Nvml, code: str | None, severity: str | None) -> None:
    found = codes(gpu_engine(nvml=nvml))
    if code is None:
        assert found == {}
    else:
        assert list(found) == [code] and found[code][0] == severity
    if code == "nvml_missing":
        assert found[code][1] == "pip install 'modelyard[gpu]'"


def test_on_simulated_gpus_a_backend_without_gpu_is_a_note() -> None:
    sim = EngineDoctor(engine="engine-0", simulated=True,
                       gpus=(Gpu(index=0, name="simulated GPU 0", total_bytes=GIB,
                                 simulated=True),),
                       nvml=Nvml(per_process="simulated"),
                       llama_server=LlamaServer(path="/b", found=True, devices=()),
                       torch=Torch(installed=True, version="2.13.0+cpu"))
    found = codes(sim)
    assert found["llama_server_no_gpu"] == ("info", BUILD_CUDA)
    assert found["torch_cpu_build"][0] == "info"
    assert "nvml_missing" not in found and "vllm_missing" not in found


def test_a_cpu_machine_has_nothing_to_say_about_gpus() -> None:
    cpu = EngineDoctor(engine="engine-0",
                       llama_server=LlamaServer(path="/b", found=True, devices=()),
                       torch=Torch(installed=True, version="2.13.0+cpu"))
    assert codes(cpu) == {}
    # … unless nvidia-smi is there and finds nothing: a driver that does not answer.
    broken = cpu.model_copy(update={"driver": Driver(nvidia_smi="/usr/bin/nvidia-smi")})
    assert codes(broken)["driver_unreadable"][0] == "error"


def test_low_disk_and_ram_and_a_down_engine() -> None:
    disks = (Disk(what="models", path="/m", total_bytes=100 * GIB, free_bytes=5 * GIB),
             Disk(what="cache", path="/c", total_bytes=100 * GIB, free_bytes=GIB))
    host = Host(cpus=2, ram_total_bytes=4 * GIB, ram_available_bytes=GIB)
    problems = diagnose([EngineDoctor(engine="engine-1", up=False, error="timed out")], host,
                        disks)
    assert [(p.code, p.severity) for p in problems] == [
        ("engine_down", "error"), ("disk_low", "error"), ("disk_low", "warning"),
        ("ram_low", "warning")]
    assert problems[0].engines == ("engine-1",) and "engine=engine-1" in problems[0].fix


def test_a_problem_seen_by_every_engine_is_listed_once() -> None:
    bad = LlamaServer(path="/b/llama-server", found=True, devices=())
    engines = [gpu_engine(engine=f"engine-{i}", llama_server=bad) for i in range(2)]
    report = assemble("0", "server", engines, HOST, DISKS)
    assert [(p.code, p.engines) for p in report.problems] == [
        ("llama_server_no_gpu", ("engine-0", "engine-1"))]
    assert report.worst == "error"
    assert DoctorReport.model_validate_json(report.model_dump_json()) == report


# ---- gathering: simulated devices, fake binaries, fake nvidia-smi, fake NVML --------------------


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def fake_llama_server(where: Path, listing: str) -> Path:
    """A llama-server that answers --version, and --list-devices with a captured listing."""
    where.mkdir(parents=True, exist_ok=True)
    return executable(where / "llama-server", (
        "#!/bin/sh\n"
        'case "$1" in\n'
        f"  --list-devices) cat '{DATA / 'list_devices' / listing}' ;;\n"
        "  --version) echo 'version: 7777 (fakebuild)' >&2 ;;\n"
        "  *) exit 1 ;;\n"
        "esac\n"))


def settings(tmp_path: Path, **fields: Any) -> Settings:
    return Settings(home=tmp_path / "home", scan_hf_cache=False, **fields)


@pytest.mark.parametrize(("listing", "problem"), [("cpu_only.txt", True),
                                                  ("cuda_h200.txt", False)])
def test_the_report_on_simulated_gpus_with_a_fake_llama_server(
        tmp_path: Path, listing: str, problem: bool) -> None:
    binary = fake_llama_server(tmp_path / listing, listing)
    s = settings(tmp_path, simulate_gpus="2x24GiB", llama_server_path=binary)
    part = gather(s, "local", simulated=simulated_gpus(s), quick=True)
    assert part.simulated and [g.name for g in part.gpus] == ["simulated GPU 0",
                                                              "simulated GPU 1"]
    assert all(g.simulated and g.total_bytes == 24 * GIB for g in part.gpus)
    assert part.nvml.per_process == "simulated"
    ls = part.llama_server
    assert ls.found and ls.configured and ls.path == str(binary)
    assert ls.version == "version: 7777 (fakebuild)"
    found = {p.code: p for p in assemble("0", "local", [part], HOST, DISKS).problems}
    if problem:
        assert ls.devices == ()
        assert found["llama_server_no_gpu"].fix.endswith(BUILD_CUDA.removeprefix("run "))
        assert "simulated" in found["llama_server_no_gpu"].message
    else:
        assert [(d.name, d.api) for d in ls.devices or ()] == [("CUDA0", "cuda")]
        assert "llama_server_no_gpu" not in found


class NoNvml:
    """A pynvml whose nvmlInit fails, as on a machine without the driver."""

    class NVMLError(Exception):
        pass

    def nvmlInit(self) -> None:
        raise self.NVMLError("Driver Not Loaded")


def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, csv: str, driver: str) -> Path:
    """`nvidia-smi` on PATH, answering the device query with a captured CSV and the driver
    query with `driver` (a driver too old for compute_cap fails that query)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    answer = (f"printf '{driver}'" if driver
              else "echo 'Field \"compute_cap\" is not a valid field'; exit 2")
    executable(bin_dir / "nvidia-smi", (
        "#!/bin/sh\n"
        'case "$1" in\n'
        f"  --query-gpu=index,uuid,*) cat '{DATA / 'smi' / csv}' ;;\n"
        f"  --query-gpu=index,driver_version,compute_cap) {answer} ;;\n"
        "  --query-gpu=index,driver_version) printf '0, 470.57.02\\n' ;;\n"
        "  *) exit 6 ;;\n"
        "esac\n"))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return bin_dir / "nvidia-smi"


def test_the_driver_and_gpus_from_nvidia_smi_and_a_cpu_llama_server(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smi = fake_smi(tmp_path, monkeypatch, "two_gpus.csv",
                   "0, 570.124.06, 8.9\\n1, 570.124.06, 8.6\\n")
    binary = fake_llama_server(tmp_path / "cpu", "cpu_only.txt")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "llama-server-11434.0.0-cuda-sm89.failed").write_text("nvcc: error")
    s = settings(tmp_path, llama_server_path=binary)
    part = gather(s, "local", quick=True, nvml=NvmlProbe(NoNvml()), nvml_bindings=None)
    assert part.llama_server.failed_builds == (
        str(tmp_path / "cache" / "llama-server-11434.0.0-cuda-sm89.failed"),)
    assert part.driver == Driver(version="570.124.06", source="nvidia-smi", nvidia_smi=str(smi))
    assert [(g.index, g.name, g.compute_capability, g.temperature_c) for g in part.gpus] == [
        (0, "NVIDIA GeForce RTX 4090", "8.9", 45), (1, "NVIDIA GeForce RTX 3090", "8.6", 71)]
    assert part.gpus[0].total_bytes == 24564 * 2**20 and not part.simulated
    assert part.nvml.per_process == "unavailable" and not part.nvml.bindings
    found = {p.code: (p.severity, p.fix) for p in diagnose([part], HOST, DISKS)}
    assert found["llama_server_no_gpu"] == ("error", "point `llama_server_path` at a CUDA or "
                                            "Vulkan build, or unset it and " + BUILD_CUDA)
    assert found["nvml_missing"] == ("warning", "pip install 'modelyard[gpu]'")


def test_a_driver_too_old_for_compute_cap(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    fake_smi(tmp_path, monkeypatch, "temp_not_supported.csv", "")  # the compute_cap query fails
    part = gather(settings(tmp_path), "local", quick=True, nvml=NvmlProbe(NoNvml()),
                  nvml_bindings=None)
    assert part.driver.version == "470.57.02" and part.gpus[0].compute_capability is None
    assert part.gpus[0].name == "Tesla T4"
    assert parse_driver_csv("0, [N/A], [N/A]\nwarning\n") == (None, {})


def test_nvidia_smi_that_finds_no_gpu_is_a_driver_problem(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho \"NVIDIA-SMI has failed because it "
               "couldn't communicate with the NVIDIA driver.\"\nexit 9\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    part = gather(settings(tmp_path), "local", quick=True, nvml=NvmlProbe(NoNvml()),
                  nvml_bindings=None)
    assert part.gpus == () and part.driver.source == "none"
    assert "driver_unreadable" in codes(part)


Proc = namedtuple("Proc", "pid usedGpuMemory")
Mem = namedtuple("Mem", "total free used")


class FakeNvml:
    """The pynvml functions the doctor adds to the probe's: driver version, compute capability
    and per-process readings, over one GPU."""

    class NVMLError(Exception):
        pass

    def __init__(self, procs: list[Proc], used: int) -> None:
        self.procs, self.used = procs, used

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"570.124.06"

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, _: int) -> str:
        return "NVIDIA H200"

    def nvmlDeviceGetUUID(self, _: int) -> str:
        return "GPU-1"

    def nvmlDeviceGetMemoryInfo(self, _: int) -> Mem:
        return Mem(141 * GIB, 141 * GIB - self.used, self.used)

    def nvmlDeviceGetCudaComputeCapability(self, _: int) -> tuple[int, int]:
        return (9, 0)

    def nvmlDeviceGetComputeRunningProcesses(self, _: int) -> list[Proc]:
        return self.procs


@pytest.mark.parametrize(("procs", "used", "verdict"), [
    ([Proc(os.getpid(), 2 * GIB)], 3 * GIB, "works"),
    ([Proc(2**22 + 17, 2 * GIB)], 3 * GIB, "foreign"),  # above pid_max: not ours
    ([Proc(os.getpid(), None)], 3 * GIB, "no_values"),
    ([], 20 * GIB, "empty"),
    ([], GIB // 2, "idle"),
])
def test_nvml_per_process_accounting(procs: list[Proc], used: int, verdict: str,
                                     tmp_path: Path) -> None:
    probe = NvmlProbe(FakeNvml(procs, used))
    part = gather(settings(tmp_path), "engine-0", quick=True, nvml=probe, nvml_bindings="12.570",
                  env={"PATH": "", "CUDA_VISIBLE_DEVICES": "0"})
    assert part.driver == Driver(version="570.124.06", source="nvml")
    assert [(g.name, g.compute_capability) for g in part.gpus] == [("NVIDIA H200", "9.0")]
    assert part.nvml.initialized and part.nvml.per_process == verdict
    # The same verdict straight from the readings.
    gpus = [DeviceInfo(0, "GPU-1", "NVIDIA H200", 141 * GIB, used, None, None, None)]
    assert nvml_accounting(probe, gpus, bindings_version="12").per_process == verdict


def test_torch_build_is_read_from_its_files_without_importing_it() -> None:
    cuda = "__version__ = '2.13.0+cu130'\ndebug = False\ncuda: Optional[str] = '13.0'\n"
    assert cuda_of_version_py(cuda) == "13.0"
    assert cuda_of_version_py("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\n") is None
    assert cuda_of_version_py('cuda = "12.8"\nhip = None\n') == "12.8"


# ---- the command -------------------------------------------------------------------------------


def run_cli(tmp_path: Path, *args: str, listing: str = "cpu_only.txt") -> Any:
    binary = fake_llama_server(tmp_path / "bin", listing)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    cfg = home / "config.yaml"
    cfg.write_text(yaml.safe_dump({"scan_hf_cache": False, "llama_server_path": str(binary),
                                   "models": []}))
    env = {"MODELYARD_HOME": str(home), "MODELYARD_URL": "http://127.0.0.1:9"}
    return CliRunner().invoke(app, ["doctor", "--config", str(cfg), *args], env=env)


def test_the_command_on_simulated_gpus(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "--simulate-gpus", "1x24GiB", "--summary")
    assert result.exit_code == 0, result.output  # on simulated GPUs it is a note
    out = " ".join(result.output.split())
    assert "1 GPU(s): simulated GPU 0" in out and "llama-server: no GPU (CPU build)" in out
    assert "note(s): `modelyard doctor` shows them" in out

    result = run_cli(tmp_path, "--simulate-gpus", "1x24GiB")
    out = " ".join(result.output.split())
    assert "gathered in this process" in out and "(simulated GPUs)" in out
    assert "GPU present but llama-server has no GPU backend" in out
    assert "version: 7777 (fakebuild)" in out
    assert "fix: point `llama_server_path` at a CUDA or Vulkan build" in out

    result = run_cli(tmp_path, "--simulate-gpus", "1x24GiB", "--json", "--summary",
                     listing="cuda_h200.txt")
    report = DoctorReport.model_validate(json.loads(result.output))
    assert report.source == "local" and report.engines[0].simulated
    assert report.engines[0].llama_server.devices is not None
    assert "llama_server_no_gpu" not in {p.code for p in report.problems}


def test_with_no_server_the_command_gathers_locally_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_smi(tmp_path, monkeypatch, "two_gpus.csv", "0, 570.124.06, 8.9\\n1, 570.124.06, 8.6\\n")
    monkeypatch.setattr(NvmlProbe, "available", lambda self: False)
    result = run_cli(tmp_path, "--summary")
    out = " ".join(result.output.split())
    assert result.exit_code == 1, out  # a CPU llama-server on real GPUs is an error
    assert "2 GPU(s): NVIDIA GeForce RTX 3090, NVIDIA GeForce RTX 4090, cc 8.6/8.9" in out
    assert "driver 570.124.06" in out
    assert "✗ error GPU present but llama-server has no GPU backend" in out
    result = run_cli(tmp_path)
    assert "no server at http://127.0.0.1:9" in " ".join(result.output.split())
