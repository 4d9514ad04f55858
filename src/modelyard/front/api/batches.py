"""OpenAI's Files and Batch APIs (docs/teams.md, "Batch API").

    POST   /v1/files                   multipart `file` + `purpose` (batch) → file object
    GET    /v1/files?purpose=&limit=&after=   {"object": "list", "data": [...]} (own; admins all)
    GET    /v1/files/{file_id}         file object
    GET    /v1/files/{file_id}/content the bytes
    DELETE /v1/files/{file_id}         {"id", "object": "file", "deleted": true}
    POST   /v1/batches                 {input_file_id, endpoint, completion_window, metadata}
    GET    /v1/batches?limit=&after=   the list
    GET    /v1/batches/{batch_id}      batch object
    POST   /v1/batches/{batch_id}/cancel

Someone else's file or batch is a 404, like one that does not exist. The runner
(front/batches/runner.py) runs the batches; a new one wakes it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from modelyard.errors import InvalidRequest
from modelyard.front.batches.files import PURPOSES, FileStore, file_object, new_id
from modelyard.front.batches.runner import BatchRunner
from modelyard.front.batches.store import BatchStore, batch_object
from modelyard.front.batches.upload import receive_upload
from modelyard.front.identity.principal import owner_key, principal_of
from modelyard.front.state import read_json_object, validate

MAX_LIST = 100


class BatchRequest(BaseModel):
    """POST /v1/batches."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1)
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                      "/v1/responses"]
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = None


class FileUpload(BaseModel):
    """The multipart form of POST /v1/files."""

    file: bytes = Field(json_schema_extra={"format": "binary"})
    purpose: Literal["batch"]


def _json(payload: Any) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


def _runner(request: Request) -> BatchRunner:
    runner: BatchRunner = request.app.state.batches
    return runner


def _files(request: Request) -> FileStore:
    return _runner(request).files


def _batches(request: Request) -> BatchStore:
    return _runner(request).store


def _limit(request: Request) -> int:
    raw = request.query_params.get("limit") or "20"
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIST:
        raise InvalidRequest(f"limit: an integer from 1 to {MAX_LIST}", param="limit")
    return int(raw)


def _page(items: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    return {"object": "list", "data": items, "has_more": len(items) == limit,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None}


async def upload(request: Request) -> Response:
    """The form is parsed as it arrives and its file written straight to disk
    (front/batches/upload.py): a 200 MiB upload costs the front a chunk, not the file."""
    principal = principal_of(request)
    files = _files(request)
    form = await receive_upload(files, owner_key(principal),
                                request.headers.get("content-type", ""), request.stream())
    try:
        if form.purpose not in PURPOSES or form.purpose != "batch":
            raise InvalidRequest(f"purpose must be batch, not {form.purpose!r}",
                                 param="purpose")
        row = await asyncio.to_thread(form.upload.commit, form.purpose, form.filename)
    except BaseException:
        await asyncio.to_thread(form.upload.discard)
        raise
    return _json(file_object(row))


async def list_files(request: Request) -> Response:
    limit = _limit(request)
    purpose = request.query_params.get("purpose") or None
    rows = await asyncio.to_thread(_files(request).list, principal_of(request), purpose, limit,
                                   request.query_params.get("after") or None)
    return _json(_page([file_object(r) for r in rows], limit))


async def get_file(request: Request) -> Response:
    row = await asyncio.to_thread(_files(request).get, request.path_params["file_id"],
                                  principal_of(request))
    return _json(file_object(row))


async def file_content(request: Request) -> Response:
    files = _files(request)
    row = await asyncio.to_thread(files.get, request.path_params["file_id"],
                                  principal_of(request))
    path = files.path(row["id"])

    async def chunks() -> Any:
        with path.open("rb") as f:  # read in the thread pool: a file can be 200 MiB
            while chunk := await asyncio.to_thread(f.read, 1024 * 1024):
                yield chunk

    # A download, never a page: a browser saves it and does not guess (sniff) another type
    # from what a batch line wrote (docs/security.md).
    name = f"{row['id']}.jsonl"
    return StreamingResponse(chunks(), media_type="application/jsonl", headers={
        "X-Content-Type-Options": "nosniff",
        "Content-Disposition": f'attachment; filename="{name}"'})


async def delete_file(request: Request) -> Response:
    file_id = request.path_params["file_id"]
    await asyncio.to_thread(_files(request).delete, file_id, principal_of(request))
    return _json({"id": file_id, "object": "file", "deleted": True})


async def create_batch(request: Request) -> Response:
    principal = principal_of(request)
    req = validate(BatchRequest, await read_json_object(request))
    files = _files(request)
    source = await asyncio.to_thread(files.get, req.input_file_id, principal)
    if source["purpose"] != "batch":
        raise InvalidRequest(f"file {req.input_file_id} is not a batch input (purpose "
                             f"{source['purpose']})", param="input_file_id")
    owner = owner_key(principal)
    batches = _batches(request)
    await asyncio.to_thread(batches.check_open, owner)
    total = await asyncio.to_thread(files.check_batch, source["id"], req.endpoint)
    output_id, error_id = new_id("file"), new_id("file")
    await asyncio.to_thread(files.new_output, output_id, owner, f"{source['id']}_output.jsonl")
    await asyncio.to_thread(files.new_output, error_id, owner, f"{source['id']}_error.jsonl")
    row = await asyncio.to_thread(
        batches.create, principal, endpoint=req.endpoint,
        input_file_id=source["id"], window=req.completion_window, meta=req.metadata,
        total=total, output_file_id=output_id, error_file_id=error_id)
    _runner(request).wake()
    return _json(batch_object(row))


async def list_batches(request: Request) -> Response:
    limit = _limit(request)
    rows = await asyncio.to_thread(_batches(request).list_batches, principal_of(request), limit,
                                   request.query_params.get("after") or None)
    return _json(_page([batch_object(r) for r in rows], limit))


async def get_batch(request: Request) -> Response:
    row = await asyncio.to_thread(_batches(request).get, request.path_params["batch_id"],
                                  principal_of(request))
    return _json(batch_object(row))


async def cancel_batch(request: Request) -> Response:
    row = await asyncio.to_thread(_batches(request).cancel, request.path_params["batch_id"],
                                  principal_of(request))
    _runner(request).cancelled(row["id"])
    return _json(batch_object(row))


routes = [
    Route("/v1/files", upload, methods=["POST"]),
    Route("/v1/files", list_files, methods=["GET"]),
    Route("/v1/files/{file_id}", get_file, methods=["GET"]),
    Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
    Route("/v1/batches", create_batch, methods=["POST"]),
    Route("/v1/batches", list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", get_batch, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
]
