"""`modelyard ps` (once) and `modelyard top` (live): GET /v1/status drawn with rich."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text


def size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return str(n)


def bar(used: int | None, total: int | None, width: int = 20) -> str:
    if used is None or not total:
        return "-"
    filled = round(width * min(1.0, used / total))
    return f"[{'#' * filled}{'.' * (width - filled)}] {size(used)} / {size(total)}"


def _expiry(model: dict[str, Any]) -> str:
    if model.get("keep_alive_s") is None:
        return "never"
    expires = model.get("expires_in_s")
    return f"{expires:.0f} s" if expires is not None else "-"


def render(view: dict[str, Any], *, swaps: int = 10) -> Group:
    """Devices, models, services, queues and pulls; only the tables that have rows."""
    summary = view["summary"]
    head = Text(
        f"modelyard {view.get('version')} · up {view.get('uptime_seconds', 0):.0f} s · "
        f"engines {summary['engines_up']}/{summary['engines']} · "
        f"models loaded {summary['models_loaded']} · running {summary['requests_running']} · "
        f"queued {summary['requests_queued']} · pulls {summary['pulls_active']}"
    )
    engines = Table("ENGINE", "DEVICE", "MEMORY", "TEMP", "LOADS", "EVICTIONS", "STATE")
    devices = {d["engine"]: d for d in view["devices"]}
    for engine in view["engines"]:
        dev = devices.get(engine["name"], {})
        temp = dev.get("temperature_c")
        state = ("down" if not engine["up"] else
                 f"cooling: {engine['cooling']}" if engine.get("cooling") else "ok")
        engines.add_row(engine["name"], str(dev.get("name", "-")),
                        bar(dev.get("used_bytes"), dev.get("total_bytes")),
                        f"{temp:.0f} °C" if temp is not None else "-", "", "", state)
        for one in dev.get("devices") or ():  # an engine owning several: one line each
            t = one.get("temperature_c")
            engines.add_row(f"  gpu{one.get('index')}", str(one.get("name") or "-"),
                            bar(one.get("used_bytes"), one.get("total_bytes")),
                            f"{t:.0f} °C" if t is not None else "-", "", "", "")
    sched = view["scheduler"]
    engines.add_row("all", "", "", "", str(sched["loads"]), str(sched["evictions"]), "")
    models = Table("MODEL", "ENGINE", "STATE", "PID", "IN FLIGHT", "MEMORY", "PLACEMENT",
                   "PROCESSOR", "EXPIRES", "LOAD TIME")
    # Models on the CPU of an engine with GPUs, and why (their backend cannot use the GPUs).
    on_cpu = Table("ON THE CPU", "WHY")
    warnings = [Text(f"warning: {e['gpu_warning']}", style="bold red")
                for e in view["engines"] if e.get("gpu_warning")]
    for engine in view["engines"]:
        for m in engine["models"]:
            load_s = m.get("load_duration_s")
            processor = m.get("processor") or "-"
            if m.get("cpu_reason"):
                processor = "CPU (see below)"
                on_cpu.add_row(m["model"], m["cpu_reason"])
            models.add_row(m["model"], engine["name"], str(m["state"]), str(m.get("pid") or "-"),
                           str(m["in_flight"]), size(m["memory_bytes"] or None),
                           m.get("placement") or "-", processor, _expiry(m),
                           f"{load_s:.2f} s" if load_s else "-")
    services = Table("SERVICE", "ENGINE", "STATE", "IN FLIGHT", "URL")
    for s in view["services"]:
        services.add_row(s["model"], s["engine"], str(s["state"]), str(s["in_flight"]),
                         s.get("url") or "-")
    queues = Table("QUEUE", "RUNNING", "QUEUED", "LIMIT", "SERVED", "REJECTED", "AVG WAIT")
    for name, q in view["queues"].items():
        queues.add_row(name, str(q["running"]), str(q["queued"]),
                       f"{q['max_concurrency']} / {q['max_queue']}", str(q["admitted_total"]),
                       str(q["rejected_total"]), f"{q['avg_wait_s']:.2f} s")
    pulls = Table("PULL", "MODEL", "STATUS", "PROGRESS")
    for p in view["pulls"]:
        pulls.add_row(p["id"], p["model"], p["status"], bar(p.get("bytes_done"),
                                                             p.get("bytes_total")))
    recent = Table("WHEN", "ENGINE", "UNLOADED", "WHY")
    for swap in sched["recent_swaps"][-swaps:]:
        recent.add_row(time.strftime("%H:%M:%S", time.localtime(swap["at"])), swap["engine"],
                       swap["unloaded"], swap["reason"])
    parts: list[Any] = [head, *warnings, engines, models]
    for table, title in ((on_cpu, None), (services, None), (queues, None), (pulls, None),
                         (recent, "recent swaps")):
        if table.row_count:
            if title:
                parts.append(Text(title))
            parts.append(table)
    return Group(*parts)
