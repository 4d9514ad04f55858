"""An engine's status as types: what `GET /status` on an engine carries, built by the engine
(engine/loop.py `Engine.status()`) and read by the front only through these attributes.

One encoder (`to_json`) and one decoder (`from_json`) per type. The JSON keeps the keys, order
and values the engine has always served (the front passes them on in its own GET /status), plus
what the placement policy reads and the front could not see before: `coexist_with`, `waiters`,
a loading model's measured bytes, what a model's next load would be promised (`load_bytes`: a
load remembers what the last one measured) and the loads waiting to be placed (`placing`).
DESIGN.md §3.11: the front predicts the engine's decision with the same code on the same
inputs. The decoder is lenient with missing keys (an engine that has not measured its device
yet reports little); the protocol version checked when a front attaches (wire/lease.py
`PROTOCOL`) is what guarantees both ends mean the same fields.

Status is parsed on status calls and cold routes only, never per request to a ready model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from modelyard.placement.devices import Placement
from modelyard.wire.speculative import SpeculativeStatus

__all__ = [
    "SCHEDULER_COUNTERS",
    "DeviceStatus",
    "EngineReport",
    "EngineStatus",
    "ModelMemory",
    "ModelStatus",
    "SchedulerStatus",
    "Swap",
]

# The scheduler's counters, in the order the engine reports them.
SCHEDULER_COUNTERS = ("loads", "evictions", "unloads", "expirations", "load_failures",
                      "crashes", "waits", "no_fit", "thermal_pauses", "warm_loads")


def _int(value: Any) -> int | None:
    return int(value) if value is not None else None


def _float(value: Any) -> float | None:
    return float(value) if value is not None else None


def _str(value: Any) -> str | None:
    return str(value) if value is not None else None


@dataclass(frozen=True, slots=True)
class DeviceStatus:
    """A device an engine owns (or their sum, or host RAM), as it measured it for this report."""

    kind: str | None = None
    name: str | None = None
    total_bytes: int = 0
    used_bytes: int | None = None
    free_bytes: int | None = None
    temperature_c: int | None = None
    utilization_pct: int | None = None
    reserved_loading_bytes: int = 0  # promised to models still loading
    # Held on this device by warm-tier models (engine/warm_tier.py): a load may take it back,
    # so planning counts it as free (placement/view.py).
    warm_bytes: int = 0
    index: int = 0  # the physical device index (in EngineStatus.devices)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "total_bytes": self.total_bytes,
            "used_bytes": self.used_bytes,
            "free_bytes": self.free_bytes,
            "temperature_c": self.temperature_c,
            "utilization_pct": self.utilization_pct,
            "reserved_loading_bytes": self.reserved_loading_bytes,
            "warm_bytes": self.warm_bytes,
            "index": self.index,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DeviceStatus:
        return cls(
            kind=_str(d.get("kind")),
            name=_str(d.get("name")),
            total_bytes=int(d.get("total_bytes") or 0),
            used_bytes=_int(d.get("used_bytes")),
            free_bytes=_int(d.get("free_bytes")),
            temperature_c=_int(d.get("temperature_c")),
            utilization_pct=_int(d.get("utilization_pct")),
            reserved_loading_bytes=int(d.get("reserved_loading_bytes") or 0),
            warm_bytes=int(d.get("warm_bytes") or 0),
            index=int(d.get("index") or 0),
        )


@dataclass(frozen=True, slots=True)
class Swap:
    """One recent unload: when, what, why (`for X`, `idle`, `unload`, `reload`), how big."""

    at: float
    unloaded: str
    reason: str
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "unloaded": self.unloaded, "reason": self.reason,
                "bytes": self.bytes}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Swap:
        return cls(float(d.get("at") or 0.0), str(d.get("unloaded")), str(d.get("reason")),
                   int(d.get("bytes") or 0))


@dataclass(frozen=True, slots=True)
class SchedulerStatus:
    """The engine's limits and counters; `counters` in SCHEDULER_COUNTERS order."""

    max_loaded_models: int | None = None
    counters: Mapping[str, int] = field(default_factory=dict)
    recent_swaps: tuple[Swap, ...] = ()
    placing: tuple[str, ...] = ()  # loads not placed yet, in the order they began

    def count(self, name: str) -> int:
        return self.counters.get(name, 0)

    def to_json(self) -> dict[str, Any]:
        return {
            "max_loaded_models": self.max_loaded_models,
            **{name: self.count(name) for name in SCHEDULER_COUNTERS},
            "recent_swaps": [s.to_json() for s in self.recent_swaps],
            "placing": list(self.placing),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SchedulerStatus:
        return cls(
            max_loaded_models=_int(d.get("max_loaded_models")),
            counters={name: int(d.get(name) or 0) for name in SCHEDULER_COUNTERS},
            recent_swaps=tuple(Swap.from_json(s) for s in d.get("recent_swaps") or ()),
            placing=tuple(str(m) for m in d.get("placing") or ()),
        )


@dataclass(frozen=True, slots=True)
class ModelMemory:
    """What a model was estimated at, promised (reserved) and measured holding."""

    estimate_bytes: int | None = None
    estimate: Mapping[str, Any] | None = None  # store/estimate.py MemoryEstimate.to_json()
    reserved_bytes: int | None = None  # while loading or loaded
    measured_bytes: int | None = None  # what the device shows its process holding
    host_bytes: int | None = None
    load_bytes: int | None = None  # what its next load on this engine would be promised

    def to_json(self) -> dict[str, Any]:
        return {
            "estimate_bytes": self.estimate_bytes,
            "estimate": dict(self.estimate) if self.estimate is not None else None,
            "reserved_bytes": self.reserved_bytes,
            "measured_bytes": self.measured_bytes,
            "host_bytes": self.host_bytes,
            "load_bytes": self.load_bytes,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ModelMemory:
        estimate = d.get("estimate")
        return cls(
            estimate_bytes=_int(d.get("estimate_bytes")),
            estimate=dict(estimate) if isinstance(estimate, Mapping) else None,
            reserved_bytes=_int(d.get("reserved_bytes")),
            measured_bytes=_int(d.get("measured_bytes")),
            host_bytes=_int(d.get("host_bytes")),
            load_bytes=_int(d.get("load_bytes")),
        )


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """One model an engine knows, in one of the states of engine/runtime.py `ModelState`.

    `last_used` is on the engine's monotonic clock: compare it only with the same engine's.
    `pinned` is what the engine treats as pinned (a self-managed service, or one without an
    unload route, too)."""

    model: str
    state: str
    backend: str | None = None
    pid: int | None = None
    upstream: str | None = None
    leases: int = 0
    loaded_at: float | None = None
    load_duration_s: float | None = None  # the last load's: the cost of loading it again
    size_bytes: int | None = None
    pinned: bool = False
    last_used: float = 0.0
    priority: int = 0
    group: str | None = None
    keep_alive_s: float | None = None
    expires_in_s: float | None = None
    waiting_for_memory_s: float | None = None
    memory: ModelMemory = field(default_factory=ModelMemory)
    backend_stats: Mapping[str, Any] | None = None  # what the backend says of itself
    restarts: int = 0
    last_error: str | None = None
    cooldown_s: float | None = None
    coexist_with: tuple[str, ...] = ()  # models it may share the device with, never evicted
    waiters: int = 0  # requests waiting to lease it: it is not idle
    # Stopped but kept ready in the warm tier: "host" (weights in host memory) or "asleep"
    # (a vLLM server in sleep mode); its `memory.host_bytes` is what it holds there.
    warm: str | None = None
    speculative: SpeculativeStatus | None = None  # a model with a draft_model
    # Where it is (or is being) loaded: devices, bytes on each, layers, host part; None when the
    # engine did not say (all of it on the group's first device).
    placement: Placement | None = None
    # Why it is placed on the CPU on an engine with GPUs: its backend cannot use them
    # (`backend has no GPU support: …`, DESIGN.md §3.15); None: it is where its placement says.
    cpu_reason: str | None = None

    @property
    def resident(self) -> bool:
        """Loaded or loading: it holds (or is promised) memory on the device."""
        return self.state in ("ready", "loading")

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "backend": self.backend,
            "state": self.state,
            "pid": self.pid,
            "upstream": self.upstream,
            "leases": self.leases,
            "loaded_at": self.loaded_at,
            "load_duration_s": self.load_duration_s,
            "size_bytes": self.size_bytes,
            "pinned": self.pinned,
            "last_used": self.last_used,
            "priority": self.priority,
            "group": self.group,
            "keep_alive_s": self.keep_alive_s,
            "expires_in_s": self.expires_in_s,
            "waiting_for_memory_s": self.waiting_for_memory_s,
            "memory": self.memory.to_json(),
            "backend_stats": dict(self.backend_stats) if self.backend_stats is not None else None,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "cooldown_s": self.cooldown_s,
            "coexist_with": list(self.coexist_with),
            "waiters": self.waiters,
            "warm": self.warm,
            # Only for a model with a draft: the keys every engine has served stay as they were.
            **({"speculative": self.speculative.to_json()} if self.speculative else {}),
            "placement": self.placement.to_json() if self.placement is not None else None,
            "cpu_reason": self.cpu_reason,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ModelStatus:
        stats = d.get("backend_stats")
        placement = d.get("placement")
        return cls(
            model=str(d["model"]),
            state=str(d.get("state") or "stopped"),
            backend=_str(d.get("backend")),
            pid=_int(d.get("pid")),
            upstream=_str(d.get("upstream")),
            leases=int(d.get("leases") or 0),
            loaded_at=_float(d.get("loaded_at")),
            load_duration_s=_float(d.get("load_duration_s")),
            size_bytes=_int(d.get("size_bytes")),
            pinned=bool(d.get("pinned")),
            last_used=float(d.get("last_used") or 0.0),
            priority=int(d.get("priority") or 0),
            group=_str(d.get("group")),
            keep_alive_s=_float(d.get("keep_alive_s")),
            expires_in_s=_float(d.get("expires_in_s")),
            waiting_for_memory_s=_float(d.get("waiting_for_memory_s")),
            memory=ModelMemory.from_json(d.get("memory") or {}),
            backend_stats=dict(stats) if isinstance(stats, Mapping) else None,
            restarts=int(d.get("restarts") or 0),
            last_error=_str(d.get("last_error")),
            cooldown_s=_float(d.get("cooldown_s")),
            coexist_with=tuple(str(m) for m in d.get("coexist_with") or ()),
            waiters=int(d.get("waiters") or 0),
            warm=_str(d.get("warm")),
            speculative=SpeculativeStatus.from_json(d.get("speculative")),
            placement=Placement.from_json(placement) if isinstance(placement, Mapping) else None,
            cpu_reason=_str(d.get("cpu_reason")),
        )


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """One engine's report: its devices, scheduler and models.

    `device` is the group's sum (what a one-device engine always reported); `devices` one
    record per device of the group (empty from an engine that reports no split: planning then
    sees one device); `host` the host RAM it measured (where an offload keeps layers)."""

    engine: int = 0
    pid: int | None = None
    started_at: float | None = None
    device: DeviceStatus = field(default_factory=DeviceStatus)
    paused: str | None = None  # why it is paused to cool down, if it is
    scheduler: SchedulerStatus = field(default_factory=SchedulerStatus)
    models: tuple[ModelStatus, ...] = ()
    devices: tuple[DeviceStatus, ...] = ()
    host: DeviceStatus | None = None
    # Model files (store/storage_id.py): the storage id it sees in its models_dir, and the
    # catalog's models whose files it cannot see (a node without the front's shared storage).
    storage_id: str | None = None
    missing_files: tuple[str, ...] = ()
    # The backends (config `reach_backend`) that cannot use this engine's GPUs, with why: their
    # models are placed in host RAM (placement/view.py reads it, so the front predicts that);
    # and the warning when no backend can use a GPU the driver reports (engine/reach.py).
    cpu_backends: Mapping[str, str] = field(default_factory=dict)
    gpu_warning: str | None = None

    def model(self, model_id: str) -> ModelStatus | None:
        return next((m for m in self.models if m.model == model_id), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "pid": self.pid,
            "started_at": self.started_at,
            "device": self.device.to_json(),
            "paused": self.paused,
            "scheduler": self.scheduler.to_json(),
            "models": [m.to_json() for m in self.models],
            "devices": [dev.to_json() for dev in self.devices],
            "host": self.host.to_json() if self.host is not None else None,
            "storage_id": self.storage_id,
            "missing_files": list(self.missing_files),
            "cpu_backends": dict(self.cpu_backends),
            "gpu_warning": self.gpu_warning,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> EngineStatus:
        models: Sequence[Mapping[str, Any]] = d.get("models") or ()
        host = d.get("host")
        return cls(
            engine=int(d.get("engine") or 0),
            pid=_int(d.get("pid")),
            started_at=_float(d.get("started_at")),
            device=DeviceStatus.from_json(d.get("device") or {}),
            paused=_str(d.get("paused")),
            scheduler=SchedulerStatus.from_json(d.get("scheduler") or {}),
            models=tuple(ModelStatus.from_json(m) for m in models),
            devices=tuple(DeviceStatus.from_json(x) for x in d.get("devices") or ()),
            host=DeviceStatus.from_json(host) if isinstance(host, Mapping) else None,
            storage_id=_str(d.get("storage_id")),
            missing_files=tuple(str(m) for m in d.get("missing_files") or ()),
            cpu_backends={str(k): str(v) for k, v in (d.get("cpu_backends") or {}).items()},
            gpu_warning=_str(d.get("gpu_warning")),
        )


@dataclass(frozen=True, slots=True)
class EngineReport:
    """An engine as the front lists it (GET /status, /admin/engines, /metrics): its name, and
    its status when it answered, or why it did not."""

    name: str
    status: EngineStatus | None = None
    error: str | None = None

    @property
    def up(self) -> bool:
        return self.status is not None

    def to_json(self) -> dict[str, Any]:
        if self.status is None:
            return {"name": self.name, "up": False, "error": self.error}
        return {"name": self.name, "up": True, **self.status.to_json()}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> EngineReport:
        if d.get("up"):
            return cls(str(d["name"]), EngineStatus.from_json(d))
        return cls(str(d["name"]), error=_str(d.get("error")))
