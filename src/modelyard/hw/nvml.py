"""Device probe through NVML (`nvidia-ml-py`, module `pynvml`), for engines.

NVML answers in microseconds without spawning a process, so an engine can poll its device often
(memory recovery after an unload, thermal protection) where nvidia-smi would cost a fork each
time. The bindings are the optional `gpu` extra and are imported lazily, inside this module only
(a lint rule keeps them out of the torch-free front).

The probe never raises for driver trouble: a missing library, a failed `nvmlInit`, a lost GPU or
an unsupported query degrades to "no devices" ([] / {}) or to a None field, with one warning per
kind of failure so a poll loop does not flood the log (missing bindings are only noted, at INFO:
the extra is optional and callers fall back to nvidia-smi). A field NVML cannot read (temperature on
many datacenter boards, utilization on MIG instances) is None, never 0 (see DeviceInfo).

Indices are NVML's, which follow PCI bus order like nvidia-smi (CUDA agrees when
CUDA_DEVICE_ORDER=PCI_BUS_ID). The `visible` argument takes a CUDA_VISIBLE_DEVICES value (indices
or UUIDs) and restricts the answer to those devices, keeping their NVML indices.

MIG: a GPU in MIG mode is reported as its MIG instances, one DeviceInfo each, because an instance
is what a CUDA process can actually allocate from. An instance carries its parent's index, its
own `MIG-...` UUID, its own memory, the parent's temperature (one die, one sensor) and no
utilization (NVML does not report it per instance). Selecting the parent (by index or GPU UUID)
selects all its instances; naming a MIG UUID selects that one. Where the instances cannot be
enumerated (old bindings, no permission, MIG enabled but no instance created), the parent is
reported as a plain GPU. Nothing more elaborate (compute instances, per-instance processes).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from modelyard.hw.devices import visible_gpus
from modelyard.types import DeviceInfo

log = logging.getLogger(__name__)

# pynvml's values, used when a (fake or old) module object does not define them.
_NVML_TEMPERATURE_GPU = 0
_NVML_DEVICE_MIG_ENABLE = 1


def _text(value: Any) -> str | None:
    """NVML strings are bytes in old bindings and str in new ones."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


class NvmlProbe:
    """Reads devices and their processes through NVML; [] / {} / None when it cannot.

    `nvml` is the pynvml module or a stand-in with the same functions (tests pass a fake); by
    default pynvml is imported on first use. NVML is initialized on first use and stays
    initialized until `shutdown()`; a failed initialization is retried on the next call (the
    driver may come up later) but warned about once per probe.
    """

    def __init__(self, nvml: Any = None) -> None:
        self._nvml: Any = nvml
        self._initialized = False
        self._warned: set[str] = set()

    # --- public API -------------------------------------------------------------------------

    def available(self) -> bool:
        """True when the bindings import and nvmlInit succeeds."""
        return self._init() is not None

    def devices(self, visible: str | None = None) -> list[DeviceInfo]:
        """Every device NVML sees (MIG instances in place of a MIG-mode GPU), ordered by index.

        `visible` is a CUDA_VISIBLE_DEVICES value; None means all devices. Devices whose total
        memory cannot be read (e.g. a lost GPU) are left out, as in hw.smi.
        """
        nvml = self._init()
        if nvml is None:
            return []
        errors = self._errors(nvml)
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except errors as exc:
            self._warn_once("count", "NVML cannot count devices: %s", exc)
            return []
        out: list[DeviceInfo] = []
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
            except errors as exc:
                self._warn_once(f"handle {index}", "NVML cannot open GPU %d: %s", index, exc)
                continue
            parent_uuid = _text(self._field(nvml, "nvmlDeviceGetUUID", handle))
            for info in self._entries(nvml, index, handle, parent_uuid):
                if visible_gpus([info], visible) or visible_gpus(
                    [replace(info, uuid=parent_uuid)], visible
                ):
                    out.append(info)
        return out

    def processes(self, index: int) -> dict[int, int]:
        """pid → GPU memory in bytes of the compute processes on NVML device `index`.

        A process whose memory NVML does not report (`usedGpuMemory` None: some drivers, MIG
        without privileges, Windows WDDM) is listed with 0, so its presence is still known. A pid
        listed more than once (several contexts) gets the sum. {} when NVML cannot answer.
        """
        nvml = self._init()
        if nvml is None:
            return {}
        errors = self._errors(nvml)
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except errors as exc:
            self._warn_once(f"processes {index}", "NVML cannot list processes on GPU %d: %s",
                            index, exc)
            return {}
        out: dict[int, int] = {}
        for proc in procs or []:
            pid = int(proc.pid)
            used = _int(getattr(proc, "usedGpuMemory", None)) or 0
            out[pid] = out.get(pid, 0) + used
        return out

    def temperature_c(self, index: int) -> int | None:
        """Die temperature of NVML device `index` (a thermal.ThermalSensors GPU reader)."""
        found = self._handle(index)
        return self._temperature(*found) if found is not None else None

    def _handle(self, index: int) -> tuple[Any, Any] | None:
        """(the NVML module, device `index`'s handle), or None when NVML cannot give it."""
        nvml = self._init()
        if nvml is None:
            return None
        try:
            return nvml, nvml.nvmlDeviceGetHandleByIndex(index)
        except self._errors(nvml):
            return None

    def driver_version(self) -> str | None:
        """The NVIDIA driver's version (e.g. 570.124.06), or None when NVML cannot say."""
        nvml = self._init()
        if nvml is None:
            return None
        return _text(self._field(nvml, "nvmlSystemGetDriverVersion"))

    def compute_capability(self, index: int) -> str | None:
        """`major.minor` of NVML device `index` (9.0 for an H100/H200), or None."""
        device = self._handle(index)
        if device is None:
            return None
        nvml, handle = device
        found = self._field(nvml, "nvmlDeviceGetCudaComputeCapability", handle)
        if not found or len(found) != 2:
            return None
        return f"{int(found[0])}.{int(found[1])}"

    def shutdown(self) -> None:
        """Release NVML (it is reference counted by the library); safe to call twice."""
        if not self._initialized:
            return
        self._initialized = False
        nvml = self._nvml
        try:
            nvml.nvmlShutdown()
        except self._errors(nvml) as exc:
            log.debug("nvmlShutdown failed: %s", exc)

    # --- internals --------------------------------------------------------------------------

    def _init(self) -> Any:
        """The initialized module, or None (after one warning) when NVML is unusable."""
        if self._initialized:
            return self._nvml
        if self._nvml is None:
            try:
                import pynvml
            except ImportError:
                # An optional extra, and callers fall back to nvidia-smi: worth a note, not a
                # warning on every CPU-only host.
                self._warn_once(
                    "import",
                    "NVML bindings are not installed (pip install 'modelyard[gpu]'); "
                    "no GPUs through NVML",
                    level=logging.INFO,
                )
                return None
            self._nvml = pynvml
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except self._errors(nvml) as exc:
            self._warn_once("init", "NVML is unavailable (nvmlInit failed: %s)", exc)
            return None
        self._initialized = True
        return nvml

    @staticmethod
    def _errors(nvml: Any) -> tuple[type[BaseException], ...]:
        # NVMLError covers driver answers; OSError a library that vanished under us.
        nvml_error: type[BaseException] = getattr(nvml, "NVMLError", OSError)
        return (nvml_error, OSError)

    def _warn_once(
        self, key: str, msg: str, *args: object, level: int = logging.WARNING
    ) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.log(level, msg, *args)

    def _field(self, nvml: Any, fn_name: str, *args: Any) -> Any:
        """nvml.<fn_name>(*args), or None if the bindings lack it or NVML refuses."""
        fn = getattr(nvml, fn_name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except self._errors(nvml) as exc:
            log.debug("NVML %s failed: %s", fn_name, exc)
            return None

    def _temperature(self, nvml: Any, handle: Any) -> int | None:
        sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", _NVML_TEMPERATURE_GPU)
        return _int(self._field(nvml, "nvmlDeviceGetTemperature", handle, sensor))

    def _info(
        self,
        nvml: Any,
        index: int,
        handle: Any,
        *,
        name: str | None = None,
        temperature_c: int | None = None,
    ) -> DeviceInfo | None:
        mem = self._field(nvml, "nvmlDeviceGetMemoryInfo", handle)
        total = None if mem is None else _int(getattr(mem, "total", None))
        if total is None:
            return None
        rates = self._field(nvml, "nvmlDeviceGetUtilizationRates", handle)
        temp = self._temperature(nvml, handle)
        return DeviceInfo(
            index=index,
            uuid=_text(self._field(nvml, "nvmlDeviceGetUUID", handle)),
            name=_text(self._field(nvml, "nvmlDeviceGetName", handle)) or name or f"GPU {index}",
            total_bytes=total,
            used_bytes=_int(getattr(mem, "used", None)),
            free_bytes=_int(getattr(mem, "free", None)),
            utilization_pct=None if rates is None else _int(getattr(rates, "gpu", None)),
            temperature_c=temp if temp is not None else temperature_c,
            kind="cuda",
        )

    def _mig_handles(self, nvml: Any, handle: Any) -> list[Any]:
        """Handles of the MIG instances of a MIG-mode GPU; [] when not in MIG mode or unknown."""
        mode = self._field(nvml, "nvmlDeviceGetMigMode", handle)
        enabled = getattr(nvml, "NVML_DEVICE_MIG_ENABLE", _NVML_DEVICE_MIG_ENABLE)
        if not mode or mode[0] != enabled:
            return []
        slots = _int(self._field(nvml, "nvmlDeviceGetMaxMigDeviceCount", handle)) or 0
        found = (self._field(nvml, "nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
                 for slot in range(slots))  # empty slots raise NotFound → None
        return [h for h in found if h is not None]

    def _entries(
        self, nvml: Any, index: int, handle: Any, parent_uuid: str | None
    ) -> list[DeviceInfo]:
        """The GPU itself, or its MIG instances when it is in MIG mode and they can be read."""
        parent = self._info(nvml, index, handle)
        migs = self._mig_handles(nvml, handle)
        if migs:
            name = f"{parent.name if parent is not None else f'GPU {index}'} MIG"
            temp = parent.temperature_c if parent is not None else self._temperature(nvml, handle)
            instances = [self._info(nvml, index, h, name=name, temperature_c=temp) for h in migs]
            readable = [i for i in instances if i is not None]
            if readable:
                return readable
        if parent is None:
            self._warn_once(f"memory {index}", "NVML cannot read the memory of GPU %d (%s)",
                            index, parent_uuid or "no uuid")
            return []
        return [parent]
