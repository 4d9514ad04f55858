"""Model management routes: pull jobs (native and Ollama), delete, copy, rescan, import.

    POST   /pull                {"model", "quantize": auto|q4|fp16|no, "init": false}
    GET    /jobs                GET /jobs/{id}      DELETE /jobs/{id}     POST /jobs/{id}/resume
    POST   /api/pull            Ollama: NDJSON progress, or one answer with "stream": false; a
                                plain name is a model here (success at once) or Ollama's library
                                mapped to a Hub GGUF (store/ollama_library.py)
    POST   /api/delete          Ollama: forget a pulled or imported model and delete its files
    POST   /api/copy            Ollama: another name for a model (an alias)
    POST   /admin/rescan        re-read disks, database and config
    POST   /admin/import        {"path": DIR}: add every GGUF under DIR (recursively)
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import orjson
import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from modelyard import db
from modelyard.errors import InvalidRequest, ModelNotFound, ModelyardError, PullNameUnknown
from modelyard.front.ops.jobs import PullJobs
from modelyard.front.state import FrontState, read_json_object, state_of, validate
from modelyard.store.catalog import DiscoveredModel, WalkLimits, WalkTooLarge, scan_model_dirs
from modelyard.store.import_roots import resolve_import_dir
from modelyard.store.ollama_library import is_plain_name, library_key, library_ref
from modelyard.store.registry import Entry


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def _jobs(state: FrontState) -> PullJobs:
    return state.catalog.jobs


class PullRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    quantize: Literal["auto", "q4", "fp16", "no"] = "auto"
    init: bool = False


async def pull(request: Request) -> Response:
    state = state_of(request)
    req = validate(PullRequest, await read_json_object(request))
    job, created = await _jobs(state).submit(req.model, req.quantize, req.init)
    return _json({"status": "accepted", "job_id": job["id"], "created": created, "job": job},
                 202)


async def list_jobs(request: Request) -> Response:
    return _json({"jobs": await _jobs(state_of(request)).list()})


async def get_job(request: Request) -> Response:
    return _json(await _jobs(state_of(request)).get(request.path_params["job_id"]))


async def cancel_job(request: Request) -> Response:
    return _json(await _jobs(state_of(request)).cancel(request.path_params["job_id"]))


async def resume_job(request: Request) -> Response:
    return _json(await _jobs(state_of(request)).resume(request.path_params["job_id"]))


# ---- Ollama ---------------------------------------------------------------------------------


class OllamaPullRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    name: str | None = None  # older clients
    stream: bool = True
    insecure: bool = False


def _digest(name: str) -> str:
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()


def _ollama_events(job: dict[str, Any], sent: set[str]) -> list[dict[str, Any]]:
    """Ollama's progress lines for one look at a job (`sent`: statuses already sent once)."""
    out: list[dict[str, Any]] = []
    if "manifest" not in sent:
        sent.add("manifest")
        out.append({"status": "pulling manifest"})
    current = job.get("current_file")
    if job["status"] == "running" and current:
        out.append({"status": f"pulling {current}", "digest": _digest(current),
                    "total": job.get("bytes_total") or 0,
                    "completed": job.get("bytes_done") or 0})
    if job["status"] == "succeeded":
        out += [{"status": "verifying sha256 digest"}, {"status": "writing manifest"},
                {"status": "success"}]
    return out


def _failure(job: dict[str, Any]) -> ModelyardError:
    message = job.get("error") or job["status"]
    err = ModelyardError(f"pull of {job['model']} {job['status']}: {message}")
    status = {"repo_not_found": 404, "revision_not_found": 404, "file_not_found": 404,
              "unknown_quant": 400, "invalid_reference": 400, "insufficient_storage": 507}
    err.status = status.get(job.get("error_code") or "", 502)  # type: ignore[misc]
    return err


async def ollama_pull(request: Request) -> Response:
    state = state_of(request)
    req = validate(OllamaPullRequest, await read_json_object(request))
    name = req.model or req.name
    if not name:
        raise InvalidRequest("`model` is required", param="model")
    ref = name.strip().removeprefix("hf.co/").removeprefix("huggingface.co/")
    library_name = None
    if is_plain_name(ref):  # Ollama's library: a model here, or a name the table maps
        if state.catalog.registry.get(ref) is not None:
            return _have_it(req.stream)
        mapped = library_ref(ref, state.catalog.settings.pull_aliases)
        if mapped is None:
            raise PullNameUnknown(name)
        ref, library_name = mapped, library_key(ref)
    jobs = _jobs(state)
    job, _ = await jobs.submit(ref)

    async def succeeded(final: dict[str, Any]) -> None:
        await state.catalog.rescan()
        if library_name is not None:  # `llama3.2:1b` then reaches what it pulled
            await _name_pulled(state, library_name, final)

    if not req.stream:
        final = await jobs.wait(job["id"])
        if final["status"] != "succeeded":
            err = _failure(final)
            return _json(err.ollama_body(), err.status)
        await succeeded(final)
        return _json({"status": "success"})

    async def lines() -> AsyncIterator[bytes]:
        sent: set[str] = set()
        async for seen in jobs.watch(job["id"]):
            if seen["status"] in ("failed", "cancelled", "interrupted"):
                yield orjson.dumps(_failure(seen).ollama_body()) + b"\n"
                return
            if seen["status"] == "succeeded":
                await succeeded(seen)
            for event in _ollama_events(seen, sent):
                yield orjson.dumps(event) + b"\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _have_it(stream: bool) -> Response:
    """A pull of a model already here: success at once, in Ollama's shapes (its stream for a
    model it has: the manifest, the digests verified, success)."""
    if not stream:
        return _json({"status": "success"})
    events = [{"status": "pulling manifest"}, {"status": "verifying sha256 digest"},
              {"status": "writing manifest"}, {"status": "success"}]
    return Response(b"".join(orjson.dumps(e) + b"\n" for e in events),
                    media_type="application/x-ndjson")


async def _name_pulled(state: FrontState, name: str, job: dict[str, Any]) -> None:
    """Make the library `name` an alias of the model its pull made (unless it names one)."""
    registry = state.catalog.registry
    entry = registry.get(str(job.get("model_id") or ""))
    if entry is None or registry.get(name) is not None:
        return

    def add(c: sa.Connection) -> None:
        c.execute(sa.insert(db.aliases).values(name=name, model=entry.name))

    await _in_db(state, add)
    await state.catalog.rescan()


class NameRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    name: str | None = None

    def target(self) -> str:
        found = self.model or self.name
        if not found:
            raise InvalidRequest("`model` is required", param="model")
        return found


async def ollama_delete(request: Request) -> Response:
    state = state_of(request)
    name = validate(NameRequest, await read_json_object(request)).target()
    entry = state.catalog.registry.resolve(name)
    if await _forget_name(state, name, entry):
        return Response(status_code=200)
    await delete_model(state, entry)
    return Response(status_code=200)


async def _forget_name(state: FrontState, name: str, entry: Entry) -> bool:
    """Delete only what `name` itself is when it is a name of its own: an alias /api/copy made
    (its model stays), or a preset /api/create made (its base model stays; one made FROM an
    uploaded blob takes the model it became with it). False: `name` is the model itself."""
    registry = state.catalog.registry
    alias = next((a for a in registry.aliases_of(entry.name)
                  if registry.get(a) is entry and _same(a, name)), None)

    def forget(c: sa.Connection) -> bool:
        if alias is not None:
            if c.execute(sa.delete(db.aliases).where(db.aliases.c.name == alias)).rowcount:
                return True
            raise InvalidRequest(f"'{alias}' is an alias of '{entry.name}' in the config; remove "
                                 "it there", param="model")
        if entry.source != "created":
            return False
        c.execute(sa.delete(db.presets).where(db.presets.c.id == entry.name))
        c.execute(sa.delete(db.aliases).where(db.aliases.c.model == entry.name))
        if entry.preset is not None and entry.preset.model == entry.name:
            c.execute(sa.delete(db.models).where(db.models.c.id == entry.name))
        return True

    if not await _in_db(state, forget):
        return False
    if alias is None:
        for engine in state.dispatch.engines:
            if engine.up and entry.id == entry.name:  # it ran as a server of its own
                await engine.unload(entry.id)
    await state.catalog.rescan()
    return True


def _same(a: str, b: str) -> bool:
    return a.strip().lower().removesuffix(":latest") == b.strip().lower().removesuffix(":latest")


async def delete_model(state: FrontState, entry: Entry) -> None:
    """Unload it everywhere, delete what a pull put on disk, forget it and its aliases."""
    if entry.preset is not None:  # a config preset: its entry carries its model's source
        raise InvalidRequest(
            f"'{entry.name}' is a preset of '{entry.preset.model}' in the config; remove it "
            "there (deleting it never deletes its model)", param="model")
    if entry.source not in ("pulled", "imported"):
        raise InvalidRequest(
            f"'{entry.name}' comes from {entry.source} ({entry.path}); modelyard deletes only "
            "models it pulled or imported — remove it from the config or the disk yourself",
            param="model",
        )
    for engine in state.dispatch.engines:
        if engine.up:
            await engine.unload(entry.id)

    def forget(c: sa.Connection) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        found = db.rows(c.execute(sa.select(db.models).where(db.models.c.id == entry.id)))
        c.execute(sa.delete(db.models).where(db.models.c.id == entry.id))
        c.execute(sa.delete(db.aliases).where(db.aliases.c.model == entry.name))
        others = db.rows(c.execute(sa.select(db.models).where(db.models.c.source == "pulled")))
        return found, others

    removed, others = await _in_db(state, forget)
    if removed and removed[0]["source"] == "pulled":
        await asyncio.to_thread(_delete_pulled_files, removed[0], others)
    await state.catalog.rescan()


def _snapshot(row: dict[str, Any]) -> Path:
    """The snapshot directory a pulled model's files are relative to."""
    path, files = row["path"], row.get("files") or []
    if row["format"] != "gguf":
        return Path(path)
    first = next((f for f in files if path.endswith("/" + f)), None)
    return Path(path[: -len(first)]) if first else Path(path).parent


def _delete_pulled_files(row: dict[str, Any], others: list[dict[str, Any]]) -> None:
    """Its snapshot links and the blobs behind them (HF cache layout) — except what another
    pulled model still uses (two quants share one mmproj; identical files share one blob)."""
    snapshot = _snapshot(row)
    other_links = {_snapshot(o) / name for o in others for name in o.get("files") or []}
    other_blobs = {link.resolve() for link in other_links}  # identical files share a blob
    for name in row.get("files") or []:
        link = snapshot / name
        target = link.resolve()
        if link in other_links or target == link:
            continue  # another model's link too, or not a link at all
        link.unlink(missing_ok=True)
        if target not in other_blobs:
            target.unlink(missing_ok=True)


class CopyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field(min_length=1)
    destination: str = Field(min_length=1)


async def ollama_copy(request: Request) -> Response:
    state = state_of(request)
    req = validate(CopyRequest, await read_json_object(request))
    entry = state.catalog.registry.resolve(req.source)
    if state.catalog.registry.get(req.destination) is not None:
        raise InvalidRequest(f"'{req.destination}' already names a model", param="destination")

    def add(c: sa.Connection) -> None:
        c.execute(sa.insert(db.aliases).values(name=req.destination, model=entry.name))

    await _in_db(state, add)
    await state.catalog.rescan()
    return Response(status_code=200)


# ---- catalog --------------------------------------------------------------------------------


async def rescan(request: Request) -> Response:
    state = state_of(request)
    await state.catalog.rescan()
    return _json({"models": [
        {"model": e.name, "origin": e.origin, "source": e.source}
        for e in state.catalog.registry.entries()
    ]})


class ImportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1)


async def import_dir(request: Request) -> Response:
    state = state_of(request)
    req = validate(ImportRequest, await read_json_object(request))
    # Over HTTP a path is checked like a file server's (store/import_roots.py).
    added = await import_models(state, resolve_import_dir(req.path, state.catalog.settings))
    return _json({"imported": added})


async def import_models(state: FrontState, directory: Path) -> list[str]:
    """Every GGUF under `directory` becomes a manual model (idempotent: a file already known
    keeps its entry); projectors are attached, never listed as models. The walk is bounded by
    the `import_max_*` settings: past them nothing is imported (a 400)."""
    settings = state.catalog.settings
    limits = WalkLimits(settings.import_max_depth, settings.import_max_entries,
                        settings.import_max_s)

    def scan() -> list[DiscoveredModel]:
        # A path the system refuses (a NUL, a name too long, no such user's ~, no permission)
        # is the caller's mistake as much as a missing folder: a 400 naming it, never a 500.
        try:
            where = directory.expanduser().resolve()
            is_dir = where.is_dir()
        except (OSError, RuntimeError, ValueError) as exc:
            raise InvalidRequest(f"{str(directory)[:200]!r}: {exc}", param="path") from exc
        if not is_dir:
            raise InvalidRequest(f"{where} is not a directory", param="path")
        try:
            return scan_model_dirs([where], limits)
        except WalkTooLarge as exc:
            raise InvalidRequest(f"{exc}: name a narrower folder", param="path") from exc

    found = await asyncio.to_thread(scan)

    def add(c: sa.Connection) -> list[str]:
        known = {r["path"] for r in db.rows(c.execute(sa.select(db.models.c.path)))}
        ids = {r["id"] for r in db.rows(c.execute(sa.select(db.models.c.id)))}
        added = []
        for model in found:
            if str(model.path) in known:
                continue
            model_id = model.id if model.id not in ids else f"{model.id}-{len(ids)}"
            c.execute(sa.insert(db.models).values(
                id=model_id, source="imported", format="gguf", path=str(model.path),
                mmproj=str(model.mmproj) if model.mmproj else None, files=[],
                added_at=time.time(),
            ))
            ids.add(model_id)
            added.append(model_id)
        return added

    added: list[str] = await _in_db(state, add)
    await state.catalog.rescan()
    return added


async def _in_db(state: FrontState, fn: Any) -> Any:
    database = state.identity.db
    assert database is not None, "the front opens its database at startup"

    def run() -> Any:
        with database.begin() as conn:
            return fn(conn)

    return await asyncio.to_thread(run)


async def delete_route(request: Request) -> Response:
    """DELETE /models/{id}: the native form of /api/delete."""
    state = state_of(request)
    entry = state.catalog.registry.get(request.path_params["model"])
    if entry is None:
        raise ModelNotFound(request.path_params["model"])
    await delete_model(state, entry)
    return _json({"model": entry.name, "status": "deleted"})


routes = [
    Route("/pull", pull, methods=["POST"]),
    Route("/jobs", list_jobs, methods=["GET"]),
    Route("/jobs/{job_id}", get_job, methods=["GET"]),
    Route("/jobs/{job_id}", cancel_job, methods=["DELETE"]),
    Route("/jobs/{job_id}/resume", resume_job, methods=["POST"]),
    Route("/models/{model:path}", delete_route, methods=["DELETE"]),
    Route("/api/pull", ollama_pull, methods=["POST"]),
    Route("/api/delete", ollama_delete, methods=["DELETE", "POST"]),
    Route("/api/copy", ollama_copy, methods=["POST"]),
    Route("/admin/rescan", rescan, methods=["POST"]),
    Route("/admin/import", import_dir, methods=["POST"]),
]
