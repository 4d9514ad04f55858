"""`GET /admin/doctor`: the engines' reports (each engine's `GET /doctor`) and the front's own
facts — host RAM and the free disk where models and caches go — as one report
(wire/doctor.py). The CLI, with no server running, reads the same host facts (`host_facts`,
`disks`) in its own process.

Light on purpose: psutil and the file system only (no NVML, no torch: those are the engines').
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import psutil

from modelyard import __version__
from modelyard.config import Settings, cache_dir
from modelyard.errors import ModelyardError
from modelyard.store.catalog import default_hf_cache_dir
from modelyard.wire.doctor import Disk, DoctorReport, EngineDoctor, Host, assemble
from modelyard.wire.engines import EngineClient

__all__ = ["disks", "host_facts", "server_report"]


def host_facts() -> Host:
    mem = psutil.virtual_memory()
    return Host(cpus=psutil.cpu_count() or 1, ram_total_bytes=int(mem.total),
                ram_available_bytes=int(mem.available))


def _existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (a models folder not made yet is on its
    parent's disk)."""
    path = path.expanduser().absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def disks(settings: Settings) -> list[Disk]:
    """Free space where models, modelyard's home and the caches go; one entry per file system
    (its uses joined: `models, home`)."""
    wanted = [("models", settings.models_dir), ("home", settings.home),
              ("cache", cache_dir()),
              ("hf cache", settings.hf_cache_dir or default_hf_cache_dir())]
    by_device: dict[int, tuple[list[str], Path]] = {}
    for what, path in wanted:
        where = _existing(path)
        try:
            device = os.stat(where).st_dev
        except OSError:
            continue
        if device in by_device:
            by_device[device][0].append(what)
        else:
            by_device[device] = ([what], where)
    out: list[Disk] = []
    for names, where in by_device.values():
        try:
            usage = shutil.disk_usage(where)
        except OSError:
            continue
        out.append(Disk(what=", ".join(names), path=str(where), total_bytes=usage.total,
                        free_bytes=usage.free))
    return out


async def _ask(engine: EngineClient) -> EngineDoctor:
    if not engine.up:
        return EngineDoctor(engine=engine.name, up=False, error="down")
    try:
        found = await engine.doctor()
    except ModelyardError as exc:
        return EngineDoctor(engine=engine.name, up=False, error=exc.message)
    return found.model_copy(update={"engine": engine.name})


async def server_report(settings: Settings, engines: list[EngineClient]) -> DoctorReport:
    """Every engine's report, asked at once, with the front's host and disks."""
    found = await asyncio.gather(*(_ask(e) for e in engines))
    host = await asyncio.to_thread(host_facts)
    where = await asyncio.to_thread(disks, settings)
    return assemble(__version__, "server", found, host, where)
