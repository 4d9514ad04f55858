"""What an engine sees for `modelyard doctor` (wire/doctor.py `EngineDoctor`): the driver and its
GPUs, NVML's per-process accounting, and each backend's build with the devices it can open.

An engine process answers it on `GET /doctor` (engine/app.py) for the GPUs its
CUDA_VISIBLE_DEVICES names; the CLI, with no server running, gathers it in its own process for
every GPU of the machine (cli/doctor.py). Never the front: NVML and torch stay out of it
(DESIGN.md §1). torch is asked in a child process — importing it here would put a CUDA context
(hundreds of MiB of the GPU) in the engine — and vLLM only by its package metadata.

Everything here blocks (child processes, NVML): call it from a thread. Nothing raises: what
cannot be read is reported as unknown.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from modelyard.config import LLAMA_SERVER_VERSION, Settings, cache_dir
from modelyard.engine.backends.llamacpp import binary_version
from modelyard.engine.ledger import simulated_device
from modelyard.hw.backend_devices import llama_server_devices
from modelyard.hw.devices import env_with_visible, visible_gpus
from modelyard.hw.nvml import NvmlProbe
from modelyard.hw.simulated import parse_simulated_gpus
from modelyard.hw.smi import RunFn, query_driver, query_gpus
from modelyard.types import DeviceInfo
from modelyard.wire.doctor import (
    Driver,
    EngineDoctor,
    Gpu,
    ListedDevice,
    LlamaServer,
    Nvml,
    Torch,
    Vllm,
)

if TYPE_CHECKING:
    from modelyard.engine.state import EngineState

__all__ = ["cuda_of_version_py", "engine_report", "gather", "nvml_accounting", "simulated_gpus",
           "torch_facts"]

# Memory in use with no process listed above this (the driver itself holds a few hundred MiB):
# NVML's per-process readings are empty, not merely idle.
_EMPTY_ABOVE_BYTES = 1024**3
LIST_DEVICES_TIMEOUT_S = 15.0
TORCH_TIMEOUT_S = 90.0

# Asked in a child process: what torch's build is and whether it opens the GPUs it is shown.
_TORCH_PROBE = """
import json, warnings
out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        import torch
        out["version"] = torch.__version__
        out["cuda"] = torch.version.cuda
        out["cuda_available"] = bool(torch.cuda.is_available())
        n = torch.cuda.device_count() if out["cuda_available"] else 0
        out["device_count"] = n
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(n)]
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
out["warning"] = next((str(w.message) for w in caught if "cuda" in str(w.message).lower()), None)
print(json.dumps(out))
"""
_CUDA_LINE = re.compile(r"""^cuda\s*(?::[^=]*)?=\s*(?:'([^']*)'|"([^"]*)"|None)""", re.M)


def simulated_gpus(settings: Settings) -> list[DeviceInfo]:
    """The machine's simulated GPUs (`simulate_gpus`), as their engines read them."""
    if not settings.simulate_gpus:
        return []
    sizes = parse_simulated_gpus(settings.simulate_gpus)
    return [simulated_device(i, size, settings.home).info() for i, size in enumerate(sizes)]


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def nvml_accounting(probe: NvmlProbe, gpus: Sequence[DeviceInfo], *,
                    bindings_version: str | None, simulated: bool = False) -> Nvml:
    """Whether NVML's per-process readings can be used on this machine (see wire/doctor.py
    `PerProcess`): the GPU check needs to know, and so does a user wondering why a model's
    memory is a device total."""
    bindings = bindings_version is not None
    if simulated:
        return Nvml(bindings=bindings, bindings_version=bindings_version,
                    per_process="simulated",
                    detail="simulated GPUs: the claims of live processes")
    if not bindings:
        return Nvml(detail="nvidia-ml-py is not installed")
    if not probe.available():
        return Nvml(bindings=True, bindings_version=bindings_version,
                    detail="nvmlInit failed (no NVIDIA driver loaded?)")
    base = {"bindings": True, "bindings_version": bindings_version, "initialized": True}
    if not gpus:
        return Nvml(**base, detail="NVML sees no GPU")
    listed = {g.index: probe.processes(g.index) for g in gpus}
    procs = {pid: n for found in listed.values() for pid, n in found.items()}
    if any(n > 0 for n in procs.values()):
        ours = [pid for pid in procs if Path(f"/proc/{pid}").exists()]
        return Nvml(**base, per_process="works" if ours else "foreign",
                    detail=f"{len(procs)} process(es) listed, {len(ours)} in this PID namespace")
    if procs:
        return Nvml(**base, per_process="no_values",
                    detail=f"{len(procs)} process(es) listed without their memory")
    busy = [g for g in gpus if (g.used_bytes or 0) > _EMPTY_ABOVE_BYTES]
    if busy:
        g = busy[0]
        return Nvml(**base, per_process="empty",
                    detail=f"GPU {g.index}: {(g.used_bytes or 0) / 1024**3:.1f} GiB in use, "
                           "no process listed")
    return Nvml(**base, per_process="idle",
                detail="no process holds GPU memory now: ask again while a model is loaded")


def _torch_build(dist: importlib.metadata.Distribution) -> str | None:
    """torch.version.cuda, read from the installed torch/version.py without importing torch."""
    try:
        text = Path(str(dist.locate_file("torch/version.py"))).read_text()
    except OSError:
        return None
    return cuda_of_version_py(text)


def cuda_of_version_py(text: str) -> str | None:
    """`cuda` of torch's version.py (`cuda: Optional[str] = '12.8'`, or None: a CPU build)."""
    match = _CUDA_LINE.search(text)
    return (match.group(1) or match.group(2)) if match else None


# What the child process said, by (python, visible devices, torch install): torch is imported
# once per install and device set, not on every report. Failures are not kept (a timeout on a
# busy machine may pass the next time).
_TORCH_SEEN: dict[tuple[str, str | None, str], dict[str, object]] = {}


def _torch_runtime(python: str, visible: str | None, stamp: str,
                   timeout_s: float) -> dict[str, object]:
    key = (python, visible, stamp)
    if key not in _TORCH_SEEN:
        found = _ask_torch(python, visible, timeout_s)
        if "error" in found:
            return found
        _TORCH_SEEN[key] = found
    return _TORCH_SEEN[key]


def _ask_torch(python: str, visible: str | None, timeout_s: float) -> dict[str, object]:
    env = env_with_visible(visible)
    try:
        done = subprocess.run([python, "-c", _TORCH_PROBE], capture_output=True, text=True,
                              timeout=timeout_s, check=False, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"error": f"importing torch took over {timeout_s:g} s"}
    except OSError as exc:
        return {"error": str(exc)}
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"the torch probe exited {done.returncode}: {tail[0]}"}
    return dict(found) if isinstance(found, dict) else {"error": "the torch probe said nothing"}


def torch_facts(*, quick: bool = False, env: Mapping[str, str] | None = None,
                timeout_s: float = TORCH_TIMEOUT_S) -> Torch:
    """torch's version and CUDA build (from its files), and — unless `quick` — whether it opens
    the GPUs `env`'s CUDA_VISIBLE_DEVICES shows it (asked in a child process, once per torch
    install)."""
    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        return Torch()
    build = Torch(installed=True, version=dist.version, cuda=_torch_build(dist))
    if quick:
        return build
    source = env if env is not None else os.environ
    try:
        stamp = str(Path(str(dist.locate_file("torch/version.py"))).stat().st_mtime_ns)
    except OSError:
        stamp = dist.version
    found = _torch_runtime(sys.executable, source.get("CUDA_VISIBLE_DEVICES"), stamp, timeout_s)
    if "error" in found:
        return build.model_copy(update={"error": str(found["error"])})
    count = found.get("device_count")
    names = found.get("devices")
    return Torch(
        installed=True,
        version=str(found.get("version") or build.version),
        cuda=str(found["cuda"]) if found.get("cuda") else None,
        cuda_available=bool(found.get("cuda_available")),
        device_count=int(count) if isinstance(count, int) else None,
        devices=tuple(str(d) for d in names) if isinstance(names, list) else (),
        warning=str(found["warning"]) if found.get("warning") else None,
    )


def _failed_builds() -> tuple[str, ...]:
    """The logs provide-llama-server.sh leaves for a GPU build that failed (it falls back to
    the CPU build and does not retry while the log is there)."""
    try:
        found = sorted(cache_dir().glob(f"llama-server-{LLAMA_SERVER_VERSION}-*.failed"))
    except OSError:
        return ()
    return tuple(str(f) for f in found)


def _llama_server(settings: Settings, env: Mapping[str, str] | None) -> LlamaServer:
    configured = settings.llama_server_path is not None
    binary = settings.resolve_llama_server()
    failed = _failed_builds()
    if binary is None:
        where = str(settings.llama_server_path) if configured else None
        return LlamaServer(path=where, configured=configured, failed_builds=failed)
    listed = llama_server_devices(binary, env, timeout_s=LIST_DEVICES_TIMEOUT_S)
    devices = None if listed is None else tuple(
        ListedDevice(name=d.name, description=d.description, total_bytes=d.total_bytes,
                     api=d.api) for d in listed)
    return LlamaServer(path=str(binary), configured=configured, found=True,
                       version=binary_version(binary), devices=devices, failed_builds=failed)


def _real_gpus(probe: NvmlProbe, visible: str | None, run: RunFn,
               smi: str | None) -> tuple[Driver, list[DeviceInfo], dict[int, str]]:
    """The driver, the GPUs `visible` names and their compute capabilities: through NVML when
    it answers, else nvidia-smi."""
    if probe.available():
        infos = probe.devices(visible)
        caps = {g.index: c for g in infos if (c := probe.compute_capability(g.index))}
        return Driver(version=probe.driver_version(), source="nvml", nvidia_smi=smi), infos, caps
    infos = visible_gpus(query_gpus(run), visible)
    version, caps = query_driver(run)
    source = "nvidia-smi" if infos or version else "none"
    return Driver(version=version, source=source, nvidia_smi=smi), infos, caps


def gather(
    settings: Settings,
    name: str,
    *,
    simulated: Sequence[DeviceInfo] = (),
    env: Mapping[str, str] | None = None,
    quick: bool = False,
    nvml: NvmlProbe | None = None,
    nvml_bindings: str | None = "given",
    run: RunFn = subprocess.run,
) -> EngineDoctor:
    """What engine `name` (or the CLI for the whole machine) sees: its `simulated` GPUs, else
    the real ones `env`'s CUDA_VISIBLE_DEVICES names (this process's environment by default).
    `quick` leaves out what takes seconds (importing torch in a child). Tests inject `nvml` (a
    probe over a fake module) with the `nvml_bindings` version it stands for, and `run`
    (nvidia-smi's runner)."""
    source = env if env is not None else os.environ
    probe = nvml if nvml is not None else NvmlProbe()
    smi = shutil.which("nvidia-smi", path=source.get("PATH"))
    bindings = _dist_version("nvidia-ml-py", "pynvml") if nvml is None else nvml_bindings
    try:
        if simulated:
            driver = Driver(nvidia_smi=smi)
            gpus = tuple(Gpu(index=g.index, name=g.name, uuid=g.uuid, total_bytes=g.total_bytes,
                             free_bytes=g.free_bytes, temperature_c=g.temperature_c,
                             simulated=True) for g in simulated)
            accounting = nvml_accounting(probe, (), bindings_version=bindings, simulated=True)
        else:
            driver, infos, caps = _real_gpus(probe, source.get("CUDA_VISIBLE_DEVICES"), run, smi)
            gpus = tuple(Gpu(index=g.index, name=g.name, uuid=g.uuid, total_bytes=g.total_bytes,
                             free_bytes=g.free_bytes, compute_capability=caps.get(g.index),
                             temperature_c=g.temperature_c) for g in infos)
            accounting = nvml_accounting(probe, infos, bindings_version=bindings)
    finally:
        if nvml is None:
            probe.shutdown()
    return EngineDoctor(
        engine=name,
        simulated=bool(simulated),
        cpu_only=settings.devices == "cpu" and not simulated,
        driver=driver,
        gpus=gpus,
        nvml=accounting,
        llama_server=_llama_server(settings, env),
        torch=torch_facts(quick=quick, env=env),
        vllm=Vllm(installed=(v := _dist_version("vllm")) is not None, version=v),
    )


def engine_report(engine: EngineState) -> EngineDoctor:
    """`GET /doctor` of `engine`: its own devices, and the backends as its children see them
    (its environment: the CUDA_VISIBLE_DEVICES of its group)."""
    sims = [i for i in engine.device.infos() if i.kind == "simulated"]
    return gather(engine.settings, f"engine-{engine.index}", simulated=sims, env=engine.env)
