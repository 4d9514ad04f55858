"""Ollama's /api/create, /api/blobs/:digest and /api/push.

/api/create turns a Modelfile into a preset (front/chat/presets.py), stored in the database
(`db.presets`) and listed by the registry like a configured one:

    FROM <model>|@sha256:<hex>   an existing model, or a blob uploaded through /api/blobs
    PARAMETER <name> <value>      Ollama options → request defaults (num_ctx → its own context)
    SYSTEM / MESSAGE              the system prompt / messages put before a chat's own
    TEMPLATE                      kept and shown by /api/show; the model's own chat template
                                  still renders (llama-server speaks Jinja, not Go templates)
    ADAPTER                       refused: modelyard does not apply LoRA adapters here

Both forms are accepted: the `modelfile` text, and the structured fields newer clients send
(`from`, `files`, `parameters`, `system`, `template`, `messages`). A blob is stored under
$home/blobs owner-only from its first byte, and kept only when its bytes hash to its name.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from modelyard import db
from modelyard.errors import InvalidRequest, NotImplementedHere
from modelyard.front.api.modelfile import build_preset, parse_modelfile
from modelyard.front.api.pulls import _in_db
from modelyard.front.chat import context
from modelyard.front.state import FrontState, read_json_object, state_of, validate

_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")


def blobs_dir(state: FrontState) -> Path:
    return Path(state.catalog.settings.home) / "blobs"


def _blob_path(state: FrontState, digest: str) -> Path:
    found = _DIGEST.fullmatch(digest)
    if found is None:
        raise InvalidRequest(f"{digest[:80]!r} is not a digest like sha256:<64 hex digits>",
                             param="digest")
    return blobs_dir(state) / f"sha256-{found.group(1)}"


async def blob_head(request: Request) -> Response:
    path = _blob_path(state_of(request), request.path_params["digest"])
    return Response(status_code=200 if path.is_file() else 404)


async def blob_upload(request: Request) -> Response:
    """Store the body under its digest; a body whose sha256 is another is a 400, and leaves
    nothing behind."""
    state = state_of(request)
    digest = request.path_params["digest"]
    path = _blob_path(state, digest)
    if path.is_file():
        return Response(status_code=200)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    part = path.with_name(f"{path.name}.{os.getpid()}.{time.monotonic_ns()}.part")
    # Owner-only from its first byte: never created readable and chmod-ed later.
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    hasher = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            async for chunk in request.stream():
                hasher.update(chunk)
                await asyncio.to_thread(out.write, chunk)
        if hasher.hexdigest() != path.name.removeprefix("sha256-"):
            raise InvalidRequest(
                f"digest mismatch: the body's sha256 is {hasher.hexdigest()}, not {digest}",
                param="digest")
        part.replace(path)
    finally:
        part.unlink(missing_ok=True)
    return Response(status_code=201)


class CreateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    name: str | None = None  # older clients
    modelfile: str | None = None
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    parameters: dict[str, Any] | None = None
    system: str | None = None
    template: str | None = None
    messages: list[dict[str, Any]] | None = None
    quantize: str | None = None
    stream: bool = True


def _fields(req: CreateRequest) -> dict[str, Any]:
    fields: dict[str, Any] = parse_modelfile(req.modelfile) if req.modelfile else {}
    extra = req.model_extra or {}
    structured = {"from": extra.get("from"), "parameters": req.parameters,
                  "system": req.system, "template": req.template, "messages": req.messages,
                  "adapters": req.adapters}
    for key, value in structured.items():
        if value:
            fields[key] = value
    if req.files:  # blobs uploaded first: the (first) GGUF among them is the model
        ggufs = [d for f, d in req.files.items() if not f.endswith(".json")]
        if ggufs:
            fields["from"] = "@" + ggufs[0]
    if not fields.get("from"):
        raise InvalidRequest("FROM (or `from`, or `files`) is required: the model to build on",
                             param="from")
    if not isinstance(fields["from"], str):
        raise InvalidRequest("`from` must be a model's name (or @sha256:<hex>)", param="from")
    return fields


async def create(request: Request) -> Response:
    state = state_of(request)
    req = validate(CreateRequest, await read_json_object(request))
    name = req.model or req.name
    if not name:
        raise InvalidRequest("`model` is required", param="model")
    if req.quantize:
        raise InvalidRequest("`quantize` is not supported by /api/create; pull a quantized "
                             "file instead", param="quantize")
    fields = _fields(req)
    registry = state.catalog.registry
    existing = registry.get(name)
    if existing is not None and existing.source != "created":
        raise InvalidRequest(f"'{name}' already names a model", param="model")
    source: str = fields["from"]
    blob = None
    if source.startswith("@") or _DIGEST.fullmatch(source):
        blob = _blob_path(state, source.removeprefix("@"))
        if not blob.is_file():
            raise InvalidRequest(f"no blob {source.removeprefix('@')}: upload it first with "
                                 "POST /api/blobs/<digest>", param="from")
        fields["from"] = name  # the blob becomes a model of that name
    else:
        fields["from"] = registry.resolve(source).name
        if fields["from"] == name:
            raise InvalidRequest(f"'{name}' cannot be made FROM itself", param="from")
    preset = build_preset(name, fields)
    if preset.ctx_size is not None:  # one no server of that model could have: a 400 now
        most = (context.max_context_of(blob) if blob is not None
                else context.max_context(registry.resolve(preset.model)))
        context.check_fits(source, most, preset.ctx_size, param="parameters.num_ctx")
    template = fields.get("template") or None

    def store(c: sa.Connection) -> None:
        c.execute(sa.delete(db.presets).where(db.presets.c.id == name))
        if blob is not None:
            c.execute(sa.delete(db.models).where(db.models.c.id == name))
            c.execute(sa.insert(db.models).values(
                id=name, source="imported", format="gguf", path=str(blob), files=[],
                added_at=time.time()))
        c.execute(sa.insert(db.presets).values(
            id=name, spec=preset.model_dump(mode="json"), template=template,
            created_at=time.time()))

    await _in_db(state, store)
    await state.catalog.rescan()
    statuses = [{"status": "using existing layer " + (blob.name if blob else "sha256:" + (
        hashlib.sha256(preset.model.encode()).hexdigest()))},
                {"status": "writing manifest"}, {"status": "success"}]
    if not req.stream:
        return Response(orjson.dumps(statuses[-1]), media_type="application/json")

    async def lines() -> AsyncIterator[bytes]:
        for s in statuses:
            yield orjson.dumps(s) + b"\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


async def push(_: Request) -> Response:
    raise NotImplementedHere("push is not supported: modelyard does not publish models to a "
                             "registry; copy the model's file where you want it instead")


routes = [
    Route("/api/create", create, methods=["POST"]),
    Route("/api/blobs/{digest}", blob_head, methods=["HEAD"]),
    Route("/api/blobs/{digest}", blob_upload, methods=["POST"]),
    Route("/api/push", push, methods=["POST"]),
]
