"""What a caller without the admin scope sees of /status, /v1/status, /models and /diag.

Those routes are open to inference clients (and to anonymous callers on loopback with auth
`auto`). A client needs to know which models exist, which are loaded and how busy the server
is; process ids, backend URLs, command lines, file paths, error logs and pull jobs are the
operator's business (and a map for an attacker). Each view keeps an allow-list of fields, so a
field added to an engine's report later stays hidden until someone decides a client needs it.
Who else uses the server is no client's business either: of each queue's `owners` (requests
running and waiting per user) a client sees its own entry only.
Admins (and the CLI, which uses the admin token) get the full reports.
"""

from __future__ import annotations

from typing import Any

from modelyard.front.ops.overview import overview

_ENGINE_FIELDS = ("name", "up", "engine", "started_at", "paused", "scheduler")
_DEVICE_FIELDS = ("index", "kind", "name", "total_bytes", "used_bytes", "free_bytes",
                  "temperature_c", "utilization_pct", "reserved_loading_bytes", "warm_bytes")
_MODEL_FIELDS = ("model", "backend", "state", "leases", "loaded_at", "load_duration_s",
                 "size_bytes", "pinned", "last_used", "priority", "group", "keep_alive_s",
                 "expires_in_s", "waiting_for_memory_s", "memory", "restarts", "cooldown_s", "warm",
                 "placement")  # where it is and its CPU/GPU split, as Ollama's /api/ps shows
_CATALOG_FIELDS = ("model", "aliases", "origin", "preset", "loaded", "backend", "format",
                   "source", "size_bytes", "load_duration", "engine")


def _pick(source: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    return {k: source[k] for k in fields if k in source}


def _device(device: Any) -> Any:
    return _pick(device, _DEVICE_FIELDS) if isinstance(device, dict) else None


def client_engine(engine: dict[str, Any]) -> dict[str, Any]:
    """One engine's /status: no pids, upstream URLs, errors (they carry paths and log lines)."""
    view = _pick(engine, _ENGINE_FIELDS)
    if "device" in engine:
        view["device"] = _device(engine["device"])
    if "devices" in engine:  # each device of its group
        view["devices"] = [_device(d) for d in engine["devices"] or ()]
    if "models" in engine:
        view["models"] = [_pick(m, _MODEL_FIELDS) for m in engine["models"]]
    return view


def client_queues(queues: dict[str, Any], owner: str) -> dict[str, Any]:
    """Each model's queue figures, with only the caller's own entry of `owners` (`owner`: the
    caller's principal.owner_key, "" for anonymous callers)."""
    return {model: {**figures, "owners": {name: mine for name, mine in
                                          (figures.get("owners") or {}).items() if name == owner}}
            for model, figures in queues.items()}


def client_status(status: dict[str, Any], owner: str) -> dict[str, Any]:
    """GET /status (the front's status_view()) for a client whose owner key is `owner`."""
    view = {**status, "engines": [client_engine(e) for e in status.get("engines", [])]}
    if "queues" in status:
        view["queues"] = client_queues(status["queues"], owner)
    return view


def client_models(models: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """GET /models for a client: no local paths."""
    return [_pick(m, _CATALOG_FIELDS) for m in models]


def client_diag(diag: dict[str, Any]) -> dict[str, Any]:
    """GET /diag for a client: the devices each engine sees, no home directory or binaries."""
    engines = []
    for engine in diag.get("engines", []):
        view = _pick(engine, ("name", "up", "engine"))
        if "device" in engine:
            view["device"] = _device(engine["device"])
        if "devices" in engine:
            view["devices"] = [_device(d) for d in engine["devices"]]
        engines.append(view)
    return {"engines": engines}


def client_overview(status: dict[str, Any], owner: str) -> dict[str, Any]:
    """GET /v1/status for a client: the overview of client_status(), without pull jobs (an
    empty list, so renderers need no special case), pids, errors or service URLs."""
    view = overview(client_status(status, owner), [])
    for engine in view["engines"]:
        for key in ("pid", "error"):
            engine.pop(key, None)
        for model in engine["models"]:
            model.pop("pid", None)
            model.pop("last_error", None)
    for service in view["services"]:
        service.pop("url", None)
    return view
