"""Which backends can use the engine's GPUs (DESIGN.md §3.15): never claim a device you cannot
use.

A llama-server built without a GPU backend keeps every layer in host RAM whatever
`--n-gpu-layers` says; a CPU build of torch runs the transformers backend on the CPU. Placing
their models "on gpu0" would count device bytes that are really in host RAM and show `100% GPU`.
So the engine asks, once, before it places anything:

* `llamacpp`: the resolved `llama-server --list-devices` under the engine's
  CUDA_VISIBLE_DEVICES (hw/backend_devices.py: cached per binary and visible set). A listing
  without a GPU device → its models go to the CPU. No listing at all (an older build without
  `--list-devices`, a wrapper script, a crash, a timeout) is *unknown*, and unknown counts as
  reachable, with a log line: a user's own older build keeps working as it did.
* `transformers`: torch's build and `torch.cuda` (engine/backends/transformers/reach.py, the
  only place that may import torch).
* `openai`, `vllm`, `service`: taken as configured (they run what the user named).

A backend that cannot use the GPUs is reported in the engine's status (`cpu_backends`, keyed by
config `reach_backend`): the policy then places its models whole in host RAM
(placement/policy.py `_on_cpu`), and the front, which plans from the same status, predicts it.
When the driver reports GPUs but no probed backend can use them, that is a loud warning at
start and in the status (`gpu_warning`) and diag — never a refusal to start.

When to ask (config `probe_backend_devices`): `auto` on real GPUs only (simulated GPUs are
reachable by every backend: that is what simulation is for); `always` on simulated GPUs too (the
tests); `never`. A CPU engine never asks: its device is host RAM already.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelyard.config import Settings
from modelyard.hw.backend_devices import BackendDevice, gpu_devices, llama_server_devices

log = logging.getLogger("modelyard.engine.reach")

__all__ = ["REASON_PREFIX", "BackendReach", "Reach", "gpu_warning", "llama_cpp_reach",
           "probe_backends", "should_probe"]

REASON_PREFIX = "backend has no GPU support: "
LIST_DEVICES_TIMEOUT_S = 15.0  # a CUDA build initializes every visible GPU first


@dataclass(frozen=True)
class Reach:
    """What one backend can use: `gpus` GPUs (None: unknown, taken as reachable), `reason` why
    it cannot use them (then its models run on the CPU), `devices` what it listed."""

    backend: str  # config `reach_backend`: llamacpp, transformers
    what: str  # "llama-server at /path", "torch 2.13.0+cpu"
    gpus: int | None
    reason: str | None = None
    devices: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "what": self.what, "gpus": self.gpus,
                "reason": self.reason, "devices": list(self.devices)}


def should_probe(mode: str, device_kind: str) -> bool:
    """Whether an engine whose devices are of `device_kind` asks its backends (module doc)."""
    if device_kind == "cpu" or mode == "never":
        return False
    return mode == "always" or device_kind != "simulated"


def _listing(devices: tuple[BackendDevice, ...]) -> str:
    return ", ".join(f"{d.name}: {d.description}" for d in devices) or "(none)"


def llama_cpp_reach(binary: Path, listed: tuple[BackendDevice, ...] | None) -> Reach:
    """What a llama-server that listed `listed` (None: no listing) can use."""
    what = f"llama-server at {binary}"
    if listed is None:
        return Reach("llamacpp", what, None)
    shown = tuple(f"{d.name}: {d.description}" for d in listed)
    gpus = gpu_devices(listed)
    if gpus:
        return Reach("llamacpp", what, len(gpus), devices=shown)
    return Reach("llamacpp", what, 0, f"{REASON_PREFIX}{what} lists no GPU "
                 f"(Available devices: {_listing(listed)})", shown)


def _llama_cpp(settings: Settings) -> Reach | None:
    binary = settings.resolve_llama_server()
    if binary is None:
        return None  # its models fail with BackendUnavailable: nothing to place
    found = llama_cpp_reach(binary, llama_server_devices(binary, None, LIST_DEVICES_TIMEOUT_S))
    if found.gpus is None:
        log.info("%s gave no device listing (`--list-devices`: an older build?): assumed to "
                 "use the GPUs", found.what)
    return found


def _transformers() -> Reach | None:
    if importlib.util.find_spec("torch") is None:
        return None
    try:  # the only module that may import torch, lazily (DESIGN.md §2)
        from modelyard.engine.backends.transformers.reach import torch_reach
    except ImportError:
        return None
    found = torch_reach()
    if found is None:
        return None
    reason = f"{REASON_PREFIX}{found.reason}" if found.reason is not None else None
    return Reach("transformers", found.what, found.gpus, reason)


def probe_backends(settings: Settings) -> dict[str, Reach]:
    """Ask each backend there is (blocking: run it in a thread); never raises."""
    out: dict[str, Reach] = {}
    probes: tuple[Callable[[], Reach | None], ...] = (
        functools.partial(_llama_cpp, settings), _transformers)
    for probe in probes:
        try:
            found = probe()
        except Exception:  # a probe must never stop an engine: unknown
            log.exception("probing a backend's devices failed: assumed reachable")
            continue
        if found is not None:
            out[found.backend] = found
    return out


def gpu_warning(found: Mapping[str, Reach], gpus: int, engine: int) -> str | None:
    """The warning when the engine has `gpus` GPUs and no backend that was asked can use them
    (None when one can, or none was asked)."""
    if gpus <= 0 or not found or any(r.reason is None for r in found.values()):
        return None
    why = "; ".join(r.reason.removeprefix(REASON_PREFIX) for r in found.values() if r.reason)
    return (f"engine {engine} owns {gpus} GPU{'s' if gpus != 1 else ''} but no backend can use "
            f"them: {why}. Its models run on the CPU. Install GPU builds (a CUDA/Vulkan "
            "llama-server via `llama_server_path`, the CUDA build of torch)")


class BackendReach:
    """One engine's knowledge of its backends' reach: asked once, in a worker thread, the first
    time anything awaits `known()` (the engine's start, or a load before it)."""

    def __init__(self, settings: Settings, device_kind: str, gpus: int, engine: int,
                 on_known: Callable[[], None] = lambda: None,
                 probe: Callable[[Settings], dict[str, Reach]] = probe_backends) -> None:
        self.settings = settings
        self.enabled = should_probe(settings.probe_backend_devices, device_kind)
        self.gpus = gpus
        self.engine = engine
        self.found: dict[str, Reach] = {}
        self.warning: str | None = None
        self._on_known = on_known
        self._probe = probe
        self._task: asyncio.Task[None] | None = None

    async def known(self) -> None:
        """Return once the backends were asked (at once when the engine does not ask)."""
        if not self.enabled:
            return
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._ask(), name="reach")
        await asyncio.shield(self._task)

    def update(self, settings: Settings) -> None:
        """A config reload: another `llama_server_path` is asked again, at the next `known()`
        (what was found stays until then)."""
        changed = settings.llama_server_path != self.settings.llama_server_path
        self.settings = settings
        if changed:
            self._task = None

    async def _ask(self) -> None:
        try:
            found = await asyncio.to_thread(self._probe, self.settings)
        except Exception:
            log.exception("probing the backends' devices failed: assumed reachable")
            found = {}
        if self._task is not asyncio.current_task():
            return  # a reload asked again meanwhile: the newer answer wins
        self.found = found
        for r in found.values():
            if r.reason is not None:
                log.warning("engine %d: %s models run on the CPU: %s", self.engine, r.backend,
                            r.reason)
        self.warning = gpu_warning(found, self.gpus, self.engine)
        if self.warning is not None:
            bar = "!" * 78
            log.warning("\n%s\n%s\n%s", bar, self.warning, bar)
        self._on_known()

    def cpu_backends(self) -> dict[str, str]:
        """The backends that cannot use the engine's GPUs, with why (what the status says)."""
        return {k: r.reason for k, r in self.found.items() if r.reason is not None}

    def reason_for(self, backend: str) -> str | None:
        found = self.found.get(backend)
        return found.reason if found is not None else None

    def to_json(self) -> dict[str, Any]:
        """For the engine's diag (and a doctor)."""
        return {"probed": self.enabled and self._task is not None and self._task.done(),
                "mode": self.settings.probe_backend_devices,
                "backends": {k: r.to_json() for k, r in self.found.items()},
                "gpu_warning": self.warning}
