"""GET /v1/status: the whole machine in one JSON (devices, engines, services, scheduler, queues,
pulls), built from what the engines report. `modelyard ps` and `modelyard top` render it.

`overview` is pure (status in, view out), so its shape is tested on canned engine reports.
"""

from __future__ import annotations

from typing import Any

_COUNTERS = ("loads", "evictions", "unloads", "expirations", "load_failures", "crashes", "waits",
             "no_fit", "thermal_pauses")


def _held_bytes(model: dict[str, Any]) -> int:
    memory = model.get("memory") or {}
    return int(memory.get("measured_bytes") or memory.get("reserved_bytes") or 0)


def _device(engine: dict[str, Any]) -> dict[str, Any] | None:
    device = engine.get("device")
    if not engine.get("up") or not device:
        return None
    total, used = device.get("total_bytes") or 0, device.get("used_bytes") or 0
    return {
        "engine": engine["name"],
        **device,
        "used_fraction": round(used / total, 4) if total else None,
        "holds": [{"model": m["model"], "bytes": _held_bytes(m)}
                  for m in engine.get("models", []) if m.get("state") not in ("stopped", None)],
    }


def _model(model: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": model["model"],
        "backend": model.get("backend"),
        "state": model.get("state"),
        "pid": model.get("pid"),
        "in_flight": model.get("leases", 0),
        "memory_bytes": _held_bytes(model),
        "keep_alive_s": model.get("keep_alive_s"),
        "expires_in_s": model.get("expires_in_s"),
        "pinned": model.get("pinned", False),
        "load_duration_s": model.get("load_duration_s"),
        "last_error": model.get("last_error"),
    }


def _engine(engine: dict[str, Any]) -> dict[str, Any]:
    models = [_model(m) for m in engine.get("models", []) if m.get("state") != "stopped"]
    return {
        "name": engine["name"],
        "up": bool(engine.get("up")),
        "pid": engine.get("pid"),
        "error": engine.get("error"),
        "cooling": engine.get("paused"),
        "models": [m for m in models if m["backend"] != "service"],
    }


def _services(engines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Registered services (TTS, STT, image): up when the engine has it ready."""
    found = []
    for engine in engines:
        for m in engine.get("models", []):
            if m.get("backend") == "service":
                found.append({"model": m["model"], "engine": engine["name"],
                              "state": m.get("state"), "healthy": m.get("state") == "ready",
                              "url": m.get("upstream"), "in_flight": m.get("leases", 0),
                              "memory_bytes": _held_bytes(m)})
    return found


def _scheduler(engines: list[dict[str, Any]]) -> dict[str, Any]:
    totals: dict[str, Any] = dict.fromkeys(_COUNTERS, 0)
    swaps = []
    for engine in engines:
        sched = engine.get("scheduler") or {}
        for key in _COUNTERS:
            totals[key] += int(sched.get(key) or 0)
        swaps += [{**s, "engine": engine["name"]} for s in sched.get("recent_swaps", [])]
    totals["recent_swaps"] = sorted(swaps, key=lambda s: s.get("at", 0))[-20:]
    return totals


def overview(status: dict[str, Any], pulls: list[dict[str, Any]]) -> dict[str, Any]:
    """`status` is the front's status_view() (engines' /status and the queues)."""
    engines = status["engines"]
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
