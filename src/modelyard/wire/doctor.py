"""`modelyard doctor` and `GET /admin/doctor` as types: what the machine offers and what stops
modelyard from using it, each problem with its fix in one line.

The facts come from three places, and only these types cross between them (DESIGN.md §3.11):

- each engine's `GET /doctor` (engine/doctor.py): the driver and the GPUs it owns, NVML's
  per-process accounting, and the backends' builds with the devices they can open (llama-server's
  `--list-devices`, torch's CUDA asked in a child process, vLLM's version from its metadata);
- the front (front/ops/doctor.py): host RAM and free disk where models and caches go;
- the CLI with no server running: both, gathered in its own process (cli/doctor.py).

`diagnose` turns the facts into problems; it is pure (no I/O), so the rules are tested as a table
and the front, the CLI and the GPU check read the same verdicts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "DISK_ERROR_BYTES",
    "DISK_WARNING_BYTES",
    "RAM_WARNING_BYTES",
    "Disk",
    "DoctorReport",
    "Driver",
    "EngineDoctor",
    "Gpu",
    "Host",
    "ListedDevice",
    "LlamaServer",
    "Nvml",
    "Problem",
    "Torch",
    "Vllm",
    "assemble",
    "diagnose",
]

GIB = 1024**3
# Free disk below these where models or caches go: a pull or a build fails part way.
DISK_WARNING_BYTES = 10 * GIB
DISK_ERROR_BYTES = 2 * GIB
# Host RAM available below this: the CPU engine, partial offloads and the warm tier run short.
RAM_WARNING_BYTES = 2 * GIB

Severity = Literal["error", "warning", "info"]
# How NVML's per-process readings (nvmlDeviceGetComputeRunningProcesses) look on this machine:
# works      processes listed with their memory, pids of this PID namespace
# foreign    processes listed, but none of their pids is ours (a container without --pid=host)
# no_values  processes listed without memory figures (some drivers, MIG without privileges)
# empty      no process listed while memory is in use (typical of some virtual machines)
# idle       nothing listed and nothing in use: cannot tell until something runs on the GPU
# unavailable  no NVML (bindings missing, nvmlInit failed) or no GPU
# simulated  simulated GPUs: their per-process figures are the claims of live processes
PerProcess = Literal["works", "foreign", "no_values", "empty", "idle", "unavailable", "simulated"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class Problem(_Model):
    code: str = Field(description="Stable name of the check, e.g. llama_server_no_gpu.")
    severity: Severity
    message: str = Field(description="What is wrong, in one line.")
    fix: str = Field(description="What to do about it, in one line.")
    engines: tuple[str, ...] = Field((), description="The engines that saw it (none: the host).")


class Gpu(_Model):
    index: int
    name: str
    uuid: str | None = None
    total_bytes: int
    free_bytes: int | None = None
    compute_capability: str | None = Field(None, description="e.g. 9.0; null: unknown.")
    temperature_c: int | None = None
    simulated: bool = False


class Driver(_Model):
    version: str | None = Field(None, description="The NVIDIA driver's; null: none answered.")
    source: Literal["nvml", "nvidia-smi", "none"] = "none"
    nvidia_smi: str | None = Field(None, description="nvidia-smi's path, when on PATH.")


class Nvml(_Model):
    bindings: bool = Field(False, description="nvidia-ml-py is installed.")
    bindings_version: str | None = None
    initialized: bool = Field(False, description="nvmlInit succeeded.")
    per_process: PerProcess = "unavailable"
    detail: str = ""


class ListedDevice(_Model):
    """One device a llama-server build can open (its `--list-devices`)."""

    name: str  # CUDA0, Vulkan0, ROCm0
    description: str
    total_bytes: int
    api: str | None = Field(None, description="cuda, vulkan, rocm…; null: not a GPU.")


class LlamaServer(_Model):
    path: str | None = Field(None, description="The binary modelyard runs; null: none found.")
    configured: bool = Field(False, description="Set by `llama_server_path` (not the built one).")
    found: bool = False
    version: str | None = Field(None, description="Its `--version` line.")
    devices: tuple[ListedDevice, ...] | None = Field(
        None, description="What `--list-devices` lists; null: unknown (it failed or timed out).")
    failed_builds: tuple[str, ...] = Field(
        (), description="Logs of GPU builds that failed (`<cache folder>.failed`): "
                        "provide-llama-server.sh does not retry them.")

    @property
    def gpu_devices(self) -> tuple[ListedDevice, ...] | None:
        return None if self.devices is None else tuple(d for d in self.devices if d.api)


class Torch(_Model):
    installed: bool = False
    version: str | None = None
    cuda: str | None = Field(None, description="torch.version.cuda; null: a CPU build.")
    cuda_available: bool | None = Field(
        None, description="torch.cuda.is_available(); null: not asked (a quick report).")
    device_count: int | None = None
    devices: tuple[str, ...] = ()
    error: str | None = Field(None, description="Why torch could not be asked.")
    warning: str | None = Field(None, description="What torch warned about CUDA, if anything.")


class Vllm(_Model):
    installed: bool = False
    version: str | None = None


class EngineDoctor(_Model):
    """What one engine sees (or the CLI, in its own process, for the whole machine)."""

    engine: str
    up: bool = True
    error: str | None = Field(None, description="Why the engine did not answer.")
    simulated: bool = Field(False, description="Its GPUs are simulated (--simulate-gpus).")
    cpu_only: bool = Field(False, description="Configured for the CPU (`devices: cpu`).")
    driver: Driver = Driver()
    gpus: tuple[Gpu, ...] = ()
    nvml: Nvml = Nvml()
    llama_server: LlamaServer = LlamaServer()
    torch: Torch = Torch()
    vllm: Vllm = Vllm()


class Disk(_Model):
    what: str = Field(description="What goes there: models, home, cache.")
    path: str
    total_bytes: int
    free_bytes: int


class Host(_Model):
    cpus: int
    ram_total_bytes: int
    ram_available_bytes: int


class DoctorReport(_Model):
    version: str = Field(description="modelyard's version.")
    source: Literal["local", "server"] = Field(
        description="local: gathered by the CLI with no server; server: the front and its "
                    "engines.")
    engines: tuple[EngineDoctor, ...]
    host: Host
    disks: tuple[Disk, ...]
    problems: tuple[Problem, ...]

    @property
    def worst(self) -> Severity | None:
        for level in ("error", "warning", "info"):
            if any(p.severity == level for p in self.problems):
                return level
        return None


def assemble(version: str, source: Literal["local", "server"], engines: Sequence[EngineDoctor],
             host: Host, disks: Sequence[Disk]) -> DoctorReport:
    """The report, with its problems (`diagnose`)."""
    return DoctorReport(version=version, source=source, engines=tuple(engines), host=host,
                        disks=tuple(disks), problems=tuple(diagnose(engines, host, disks)))


# ---- the rules ---------------------------------------------------------------------------------

_BUILD_CUDA = "run `MODELYARD_ACCEL=cuda make llama-server` (needs nvcc)"


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def _engine_problems(e: EngineDoctor) -> Iterable[tuple[str, Severity, str, str]]:
    """(code, severity, message, fix) for what one engine sees."""
    if not e.up:
        yield ("engine_down", "error", f"{e.engine} did not answer: {e.error or 'down'}",
               f"read its log: GET /admin/logs?engine={e.engine}; the front restarts it")
        return
    real = [g for g in e.gpus if not g.simulated]
    nvidia = real and not e.cpu_only
    # Simulated GPUs are reachable by every backend (that is what they are for): a mismatch is
    # worth knowing, not an error.
    gpu_level: Severity = "error" if nvidia else "info"
    some_gpu = bool(e.gpus) and not e.cpu_only
    note = "" if nvidia else " (the GPUs are simulated: models are placed on them anyway)"

    if e.driver.nvidia_smi and not e.driver.version and not e.gpus and not e.cpu_only:
        yield ("driver_unreadable", "error",
               f"nvidia-smi is installed ({e.driver.nvidia_smi}) but no NVIDIA GPU answered",
               "run `nvidia-smi` to see why; load or reinstall the NVIDIA driver (reboot after "
               "a driver update)")

    # NVML: how the engine measures what each model holds.
    if nvidia:
        if not e.nvml.bindings:
            yield ("nvml_missing", "warning",
                   "nvidia-ml-py is missing: GPU memory is read through nvidia-smi, with no "
                   "per-process figures", "pip install 'modelyard[gpu]'")
        elif not e.nvml.initialized:
            yield ("nvml_unavailable", "error",
                   f"NVML does not initialize although the driver reports GPUs: {e.nvml.detail}",
                   "the NVML library must match the kernel driver: reboot after a driver update, "
                   "or reinstall the driver")
        elif e.nvml.per_process == "empty":
            yield ("nvml_per_process_empty", "warning",
                   f"NVML lists no GPU process while memory is in use ({e.nvml.detail}); common "
                   "on virtual machines", "nothing to fix in modelyard: it measures a load by "
                   "the device's used-memory change (per-process figures need bare metal or "
                   "GPU passthrough)")
        elif e.nvml.per_process == "foreign":
            yield ("nvml_per_process_foreign", "warning",
                   f"NVML lists GPU processes of another PID namespace ({e.nvml.detail})",
                   "run the container with `--pid=host` so per-model memory can be measured")

    # llama-server: GGUF models.
    ls = e.llama_server
    if not ls.found:
        fix = ("fix `llama_server_path` or unset it to use the built one" if ls.configured
               else "run `make llama-server`, or set `llama_server_path` to a build")
        where = f" at {ls.path}" if ls.path else ""
        yield ("llama_server_missing", "warning",
               f"no llama-server binary{where}: GGUF models cannot be served", fix)
    elif some_gpu and ls.devices is None:
        yield ("llama_server_devices_unknown", "warning",
               f"llama-server ({ls.path}) did not list its devices (`--list-devices` failed, "
               "timed out or is too old): whether it can use the GPU is unknown",
               f"check that `{ls.path} --list-devices` runs; use a current build "
               f"({_BUILD_CUDA})")
    elif some_gpu and not ls.gpu_devices:
        fix = (f"point `llama_server_path` at a CUDA or Vulkan build, or unset it and "
               f"{_BUILD_CUDA}" if ls.configured else _BUILD_CUDA)
        if ls.failed_builds and not ls.configured:
            fix = (f"a GPU build failed before: read {ls.failed_builds[0]}, fix what it says, "
                   f"delete it, then {_BUILD_CUDA}")
        yield ("llama_server_no_gpu", gpu_level,
               f"GPU present but llama-server has no GPU backend ({ls.path} lists no GPU): "
               f"GGUF models run on the CPU{note}", fix)

    # torch: the transformers backend.
    t = e.torch
    if not t.installed:
        yield ("torch_missing", "info",
               "torch is not installed: no transformers backend (safetensors models)",
               "pip install 'modelyard[transformers]'")
    elif t.error is not None:
        yield ("torch_broken", "warning", f"torch {t.version or ''} does not import: {t.error}",
               "reinstall with `make install`")
    elif some_gpu and t.cuda is None:
        yield ("torch_cpu_build", gpu_level,
               f"torch {t.version} is a CPU build on a machine with "
               f"{'an NVIDIA GPU' if nvidia else 'GPUs'}: transformers models run on the "
               f"CPU{note}", "reinstall with `make install`")
    elif nvidia and t.cuda_available is False:
        yield ("torch_cuda_unavailable", "error",
               f"torch {t.version} (CUDA {t.cuda}) cannot open the GPU: "
               "torch.cuda.is_available() is false",
               f"update the NVIDIA driver to one for CUDA {t.cuda}, or reinstall torch with "
               "`make install`")
    if nvidia and not e.vllm.installed:
        yield ("vllm_missing", "info",
               "vLLM is not installed: safetensors models are served by transformers",
               "pip install vllm (optional; preferred for safetensors on CUDA)")


def diagnose(engines: Sequence[EngineDoctor], host: Host,
             disks: Sequence[Disk]) -> list[Problem]:
    """Every problem, worst first; one seen by several engines is listed once, naming them."""
    seen: dict[tuple[str, Severity, str, str], list[str]] = {}
    for e in engines:
        for found in _engine_problems(e):
            seen.setdefault(found, []).append(e.engine)
    problems = [Problem(code=c, severity=s, message=m, fix=f, engines=tuple(names))
                for (c, s, m, f), names in seen.items()]
    for d in disks:
        if d.free_bytes < DISK_WARNING_BYTES:
            problems.append(Problem(
                code="disk_low", severity="error" if d.free_bytes < DISK_ERROR_BYTES else "warning",
                message=f"{_gib(d.free_bytes)} free on {d.path} ({d.what})",
                fix=f"free space on {d.path}, or move `MODELYARD_HOME`/`models_dir` to a larger "
                    "disk"))
    if host.ram_available_bytes < RAM_WARNING_BYTES:
        problems.append(Problem(
            code="ram_low", severity="warning",
            message=f"{_gib(host.ram_available_bytes)} of host RAM available "
                    f"(of {_gib(host.ram_total_bytes)})",
            fix="stop other programs, or lower `warm_tier_bytes` and the models' context sizes"))
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(problems, key=lambda p: order[p.severity])
