"""GET /v1/status: the whole machine in one JSON (devices, engines, services, scheduler, queues,
pulls), built from what the engines report. `modelyard ps` and `modelyard top` render it.

`overview` is pure (status in, view out), so its shape is tested on canned engine reports.
"""

from __future__ import annotations

from typing import Any

from modelyard.wire.status import EngineReport, ModelStatus

_COUNTERS = ("loads", "evictions", "unloads", "expirations", "load_failures", "crashes", "waits",
             "no_fit", "thermal_pauses")


def _held_bytes(model: ModelStatus) -> int:
    return model.memory.measured_bytes or model.memory.reserved_bytes or 0


def _device(report: EngineReport) -> dict[str, Any] | None:
    status = report.status
    if status is None:
        return None
    device = status.device
    total, used = device.total_bytes, device.used_bytes or 0
    return {
        "engine": report.name,
        **device.to_json(),
        "used_fraction": round(used / total, 4) if total else None,
        "holds": [{"model": m.model, "bytes": _held_bytes(m)}
                  for m in status.models if m.state != "stopped"],
        # Each device of the engine's group (the figures above are their sum).
        "devices": [d.to_json() for d in status.devices] if len(status.devices) > 1 else [],
    }


def _placement_label(model: ModelStatus, kind: str | None) -> str | None:
    if model.placement is None or not model.placement.device_bytes:
        # On the CPU of an engine with GPUs: its backend cannot use them (cpu_reason).
        return "cpu" if model.placement is not None and model.placement.host_bytes else None
    return model.placement.label("cpu" if kind == "cpu" else "gpu")


def _processor(model: ModelStatus, kind: str | None) -> str | None:
    if model.placement is None:
        return None
    return "100% CPU" if kind == "cpu" else model.placement.split_label()


def _model(model: ModelStatus, kind: str | None = None) -> dict[str, Any]:
    return {
        "model": model.model,
        "backend": model.backend,
        "state": model.state,
        "pid": model.pid,
        "in_flight": model.leases,
        # On the CPU of an engine with GPUs it holds host RAM only: what it was placed with.
        "memory_bytes": _held_bytes(model) or (
            model.placement.host_bytes if model.placement is not None else 0),
        # Where it is: `gpu0+gpu1`, and Ollama's PROCESSOR split (`48%/52% CPU/GPU`).
        "placement": _placement_label(model, kind),
        "processor": _processor(model, kind),
        # Why it runs on the CPU of an engine with GPUs (`backend has no GPU support: …`).
        "cpu_reason": model.cpu_reason,
        "keep_alive_s": model.keep_alive_s,
        "expires_in_s": model.expires_in_s,
        "pinned": model.pinned,
        "load_duration_s": model.load_duration_s,
        "last_error": model.last_error,
    }


def _models(report: EngineReport) -> tuple[ModelStatus, ...]:
    return report.status.models if report.status is not None else ()


def _engine(report: EngineReport) -> dict[str, Any]:
    status = report.status
    kind = status.device.kind if status is not None else None
    models = [_model(m, kind) for m in _models(report) if m.state != "stopped"]
    return {
        "name": report.name,
        "up": report.up,
        "pid": status.pid if status is not None else None,
        "error": report.error,
        "cooling": status.paused if status is not None else None,
        # GPUs the driver reports that no backend can use (engine/reach.py).
        "gpu_warning": status.gpu_warning if status is not None else None,
        "models": [m for m in models if m["backend"] != "service"],
    }


def _services(reports: list[EngineReport]) -> list[dict[str, Any]]:
    """Registered services (TTS, STT, image): up when the engine has it ready."""
    return [{"model": m.model, "engine": report.name, "state": m.state,
             "healthy": m.state == "ready", "url": m.upstream, "in_flight": m.leases,
             "memory_bytes": _held_bytes(m)}
            for report in reports for m in _models(report) if m.backend == "service"]


def _scheduler(reports: list[EngineReport]) -> dict[str, Any]:
    totals: dict[str, Any] = dict.fromkeys(_COUNTERS, 0)
    swaps = []
    for report in reports:
        if report.status is None:
            continue
        sched = report.status.scheduler
        for key in _COUNTERS:
            totals[key] += int(sched.counters.get(key) or 0)
        swaps += [{**s.to_json(), "engine": report.name} for s in sched.recent_swaps]
    totals["recent_swaps"] = sorted(swaps, key=lambda s: s.get("at", 0))[-20:]
    return totals


def overview(status: dict[str, Any], pulls: list[dict[str, Any]]) -> dict[str, Any]:
    """`status` is the front's status_view() (engines' /status and the queues); each engine's
    report is read through its wire type (wire/status.py), never by its JSON keys."""
    engines = [EngineReport.from_json(e) for e in status["engines"]]
    queues: dict[str, dict[str, Any]] = status.get("queues", {})
    views = [_engine(e) for e in engines]
    return {
        "version": status.get("version"),
        "uptime_seconds": status.get("uptime_seconds"),
        "summary": {
            "engines": len(engines),
            "engines_up": sum(1 for e in views if e["up"]),
            "models_loaded": sum(1 for e in views for m in e["models"] if m["state"] == "ready"),
            "requests_running": sum(q.get("running", 0) for q in queues.values()),
            "requests_queued": sum(q.get("queued", 0) for q in queues.values()),
            "pulls_active": len(pulls),
            "cooling": [e["name"] for e in views if e["cooling"]],
        },
        "devices": [d for d in (_device(e) for e in engines) if d is not None],
        "engines": views,
        "services": _services(engines),
        "scheduler": _scheduler(engines),
        "queues": queues,
        "chat_sessions": status.get("chat_sessions"),  # count, bytes, evictions
        "pulls": [{"id": j["id"], "model": j["model"], "status": j["status"],
                   "bytes_done": j.get("bytes_done"), "bytes_total": j.get("bytes_total"),
                   "current_file": j.get("current_file")} for j in pulls],
    }
