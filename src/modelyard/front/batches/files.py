"""/v1/files' store: rows in `db.files`, bytes under $MODELYARD_HOME/files/<id>, and the check a
batch input passes before it is accepted.

Every file is the owner's only from its first byte (created 0600 with O_EXCL; DESIGN §3.12).
An owner sees their own files; admins see all (`visible`). Calls are blocking: the API runs them
with `asyncio.to_thread`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson
import sqlalchemy as sa

from modelyard import db
from modelyard.errors import PayloadTooLarge
from modelyard.front.batches.errors import FileNotFound, InvalidBatchFile
from modelyard.front.identity.principal import Principal, owner_key

# The endpoints a batch line may call (what OpenAI's batch API runs, less moderations).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
PURPOSES = ("batch", "batch_output")  # uploads are `batch`; outputs and errors `batch_output`
_COPY_CHUNK = 1024 * 1024


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One request of a batch input (its line number is 1-based, as editors count)."""

    line_no: int
    custom_id: str
    url: str
    model: str
    body: bytes  # the request body, re-encoded once at validation


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's file object."""
    return {"id": row["id"], "object": "file", "bytes": row["size_bytes"],
            "created_at": int(row["created_at"]), "filename": row["filename"],
            "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


def visible(principal: Principal, owner: str) -> bool:
    """Files and batches: an owner sees their own (anonymous callers share ""), admins all."""
    return principal.is_admin or owner_key(principal) == owner


def parse_batch_input(lines: Iterator[bytes], endpoint: str | None = None) -> list[BatchLine]:
    """The requests of a batch input; a line that is not one is a 400 naming its number. With
    `endpoint`, every line must call it (a batch runs one endpoint)."""
    out: list[BatchLine] = []
    seen: set[str] = set()
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"line {n}"
        try:
            item = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise InvalidBatchFile(f"{where} is not JSON: {exc}", param=where) from None
        if not isinstance(item, dict):
            raise InvalidBatchFile(f"{where} is not a JSON object", param=where)
        custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url",
                                                                "body"))
        if not isinstance(custom_id, str) or not custom_id:
            raise InvalidBatchFile(f"{where}: custom_id must be a non-empty string", param=where)
        if custom_id in seen:
            raise InvalidBatchFile(f"{where}: custom_id {custom_id!r} appears twice; each "
                                   "line needs its own", param=where)
        seen.add(custom_id)
        if method != "POST":
            raise InvalidBatchFile(f"{where}: method must be POST, not {method!r}", param=where)
        if url not in ENDPOINTS:
            raise InvalidBatchFile(f"{where}: url {url!r} is not one of {', '.join(ENDPOINTS)}",
                                   param=where)
        if endpoint is not None and url != endpoint:
            raise InvalidBatchFile(f"{where}: url {url!r} differs from the batch's endpoint "
                                   f"{endpoint!r}", param=where)
        if not isinstance(body, dict) or not isinstance(body.get("model"), str) \
                or not body["model"]:
            raise InvalidBatchFile(f"{where}: body must be an object naming its model",
                                   param=where)
        if body.get("stream"):
            raise InvalidBatchFile(f"{where}: a batch line cannot stream", param=where)
        out.append(BatchLine(n, custom_id, url, body["model"], orjson.dumps(body)))
    if not out:
        raise InvalidBatchFile("the file holds no request (one JSON object per line)")
    return out


class FileStore:
    def __init__(self, database: sa.Engine, root: Path, max_bytes: int) -> None:
        self.db = database
        self.root = root
        self.max_bytes = max_bytes

    def path(self, file_id: str) -> Path:
        if "/" in file_id or file_id.startswith("."):
            raise FileNotFound(file_id)
        return self.root / file_id

    def _create_empty(self, file_id: str) -> int:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        return os.open(self.path(file_id), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)

    def save(self, owner: str, purpose: str, filename: str, source: IO[bytes]) -> dict[str, Any]:
        """Copy an upload in (at most `max_bytes`), check it is a batch input when it says it
        is one, and record it. A rejected upload leaves nothing behind."""
        file_id = new_id("file")
        path = self.path(file_id)
        size = 0
        try:
            with os.fdopen(self._create_empty(file_id), "wb") as out:
                while chunk := source.read(_COPY_CHUNK):
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise PayloadTooLarge(f"the file is over {self.max_bytes} bytes "
                                              "(files_max_bytes)")
                    out.write(chunk)
            if purpose == "batch":
                self.read_batch(file_id)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        row = {"id": file_id, "owner": owner, "purpose": purpose, "filename": filename,
               "size_bytes": size, "created_at": time.time()}
        with self.db.begin() as conn:
            conn.execute(db.files.insert().values(**row))
        return row

    def new_output(self, file_id: str, owner: str, filename: str) -> None:
        """An empty output (or error) file of a batch, appended to as lines finish."""
        os.close(self._create_empty(file_id))
        with self.db.begin() as conn:
            conn.execute(db.files.insert().values(
                id=file_id, owner=owner, purpose="batch_output", filename=filename,
                size_bytes=0, created_at=time.time()))

    def sync_size(self, file_id: str) -> None:
        size = self.path(file_id).stat().st_size
        with self.db.begin() as conn:
            conn.execute(db.files.update().where(db.files.c.id == file_id)
                         .values(size_bytes=size))

    def read_batch(self, file_id: str, endpoint: str | None = None) -> list[BatchLine]:
        with self.path(file_id).open("rb") as f:
            return parse_batch_input(iter(f), endpoint)

    def get(self, file_id: str, principal: Principal | None = None) -> dict[str, Any]:
        with self.db.connect() as conn:
            row = conn.execute(sa.select(db.files).where(db.files.c.id == file_id)).first()
        if row is None or (principal is not None and not visible(principal, row.owner)):
            raise FileNotFound(file_id)
        return dict(row._mapping)

    def list(self, principal: Principal, purpose: str | None, limit: int,
             after: str | None) -> list[dict[str, Any]]:
        """Newest first; `after`: the last id of the previous page."""
        q = sa.select(db.files).order_by(db.files.c.created_at.desc(), db.files.c.id.desc())
        if not principal.is_admin:
            q = q.where(db.files.c.owner == owner_key(principal))
        if purpose:
            q = q.where(db.files.c.purpose == purpose)
        if after:
            mark = self.get(after, principal)
            q = q.where(sa.or_(db.files.c.created_at < mark["created_at"],
                               sa.and_(db.files.c.created_at == mark["created_at"],
                                       db.files.c.id < mark["id"])))
        with self.db.connect() as conn:
            return db.rows(conn.execute(q.limit(limit)))

    def delete(self, file_id: str, principal: Principal) -> None:
        self.get(file_id, principal)
        with self.db.begin() as conn:
            conn.execute(db.files.delete().where(db.files.c.id == file_id))
        self.path(file_id).unlink(missing_ok=True)

    def delete_unchecked(self, file_id: str) -> None:
        """The runner's: an empty error file of a finished batch goes (OpenAI leaves it null)."""
        with self.db.begin() as conn:
            conn.execute(db.files.delete().where(db.files.c.id == file_id))
        self.path(file_id).unlink(missing_ok=True)

    def copy_to(self, file_id: str, out: IO[bytes]) -> None:
        with self.path(file_id).open("rb") as f:
            shutil.copyfileobj(f, out)
