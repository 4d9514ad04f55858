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
import shlex
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
from modelyard.config import Preset
from modelyard.errors import InvalidRequest, NotImplementedHere
from modelyard.front.api.pulls import _in_db
from modelyard.front.state import FrontState, read_json_object, state_of, validate

_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")
# Modelfile PARAMETER names → OpenAI request fields (the names Ollama's `options` take).
PARAMETERS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "seed": "seed", "stop": "stop", "num_predict": "max_tokens",
    "repeat_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "typical_p": "typical_p",
}
_ROLES = ("system", "user", "assistant", "tool")


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


def parse_modelfile(text: str) -> dict[str, Any]:
    """A Modelfile's instructions as the structured fields (`from`, `parameters`, …)."""
    out: dict[str, Any] = {"parameters": {}, "messages": []}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        command, rest = word.upper(), rest.strip()
        if command == "PARAMETER":
            key, _, value = rest.partition(" ")
            _add_parameter(out["parameters"], key.strip(), value.strip())
        elif command == "MESSAGE":
            role, _, content = rest.partition(" ")
            content, i = _value(content.strip(), lines, i)
            out["messages"].append({"role": role.strip(), "content": content})
        elif command in ("FROM", "SYSTEM", "TEMPLATE", "LICENSE", "ADAPTER"):
            value, i = _value(rest, lines, i)
            out["adapter" if command == "ADAPTER" else command.lower()] = value
        else:
            raise InvalidRequest(f"Modelfile: unknown instruction {word!r}", param="modelfile")
    return out


def _value(rest: str, lines: list[str], i: int) -> tuple[str, int]:
    """An instruction's value: a triple-quoted one (up to its closing quotes, maybe lines
    later), a "quoted" one, or the rest of the line; and the next line to read."""
    if rest.startswith('"""'):
        body = rest[3:]
        while '"""' not in body and i < len(lines):
            body += "\n" + lines[i]
            i += 1
        return body.split('"""', 1)[0], i
    if len(rest) >= 2 and rest[0] == rest[-1] == '"':
        return rest[1:-1], i
    return rest, i


def _add_parameter(params: dict[str, Any], key: str, raw: str) -> None:
    value: Any = raw
    if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
        value = shlex.split(raw)[0]
    else:
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                continue
    if key == "stop":  # repeated: a list
        params.setdefault("stop", []).append(str(value))
    else:
        params[key] = value


def build_preset(name: str, fields: dict[str, Any]) -> Preset:
    """The preset the Modelfile fields describe; `from` is already the model it runs."""
    if fields.get("adapter") or fields.get("adapters"):
        raise InvalidRequest("ADAPTER is not supported: modelyard does not apply LoRA adapters "
                             "to a model; merge the adapter into the weights and create from "
                             "that file", param="adapters")
    params: dict[str, Any] = {}
    ctx_size = None
    for key, value in (fields.get("parameters") or {}).items():
        if key == "num_ctx":
            if not isinstance(value, int) or value <= 0:
                raise InvalidRequest("PARAMETER num_ctx must be a positive integer",
                                     param="parameters.num_ctx")
            ctx_size = value
        elif key in PARAMETERS:
            params[PARAMETERS[key]] = [value] if key == "stop" and isinstance(value, str) \
                else value
        else:
            raise InvalidRequest(
                f"PARAMETER {key!r} is not supported; supported: num_ctx, "
                f"{', '.join(sorted(PARAMETERS))}", param=f"parameters.{key}")
    messages = fields.get("messages") or []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(
                m.get("content"), str):
            raise InvalidRequest(f"MESSAGE needs a role among {', '.join(_ROLES)} and a text",
                                 param="messages")
    return Preset(id=name, model=fields["from"], ctx_size=ctx_size, parameters=params,
                  system=fields.get("system") or None,
                  messages=[{"role": m["role"], "content": m["content"]} for m in messages])


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
