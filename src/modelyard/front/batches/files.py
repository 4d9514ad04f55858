"""/v1/files' store: rows in `db.files`, bytes under $MODELYARD_HOME/files/<id>, and the check a
batch input passes before it is accepted.

Every file is the owner's only from its first byte (created 0600 with O_EXCL; DESIGN §3.12).
An owner sees their own files; admins see all (`visible`). Calls are blocking: the API runs them
with `asyncio.to_thread`.

Nothing here holds a file in memory: an upload is written as it arrives (`Upload`), a batch input
is checked and indexed one line at a time (`scan_batch`), and a line is read back by its offset
when it runs (`read_line`). What one owner may hold is bounded (`files_max_total_bytes_per_owner`),
and a full disk is a 507, as the database's is (db.py).
"""

from __future__ import annotations

import contextlib
import errno
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
from modelyard.errors import InsufficientStorage, PayloadTooLarge
from modelyard.front.batches.errors import FileNotFound, FilesOverQuota, InvalidBatchFile
from modelyard.front.identity.principal import Principal, owner_key

# The endpoints a batch line may call (what OpenAI's batch API runs, less moderations).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
PURPOSES = ("batch", "batch_output")  # uploads are `batch`; outputs and errors `batch_output`
_COPY_CHUNK = 1024 * 1024
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # EFBIG: a file size limit (ulimit -f)


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One request of a batch input (its line number is 1-based, as editors count)."""

    line_no: int
    custom_id: str
    url: str
    model: str
    body: bytes  # the request body, re-encoded once at validation


@dataclass(frozen=True, slots=True)
class Entry:
    """What the runner keeps of a line until it runs: where it starts, not its text."""

    line_no: int
    offset: int
    custom_id: str
    model: str


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


@contextlib.contextmanager
def disk_full_is_507() -> Iterator[None]:
    """A full disk is the operator's to fix, not a server bug: 507, as the database's (db.py)."""
    try:
        yield
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            raise InsufficientStorage(
                "the disk holding the files (MODELYARD_HOME/files) is full; nothing was kept "
                f"(free some space): {exc.strerror}") from exc
        raise


def parse_line(raw: bytes, n: int, endpoint: str | None) -> BatchLine | None:
    """Line `n` as a request (None for a blank line); one that is not is a 400 naming it."""
    if not raw.strip():
        return None
    where = f"line {n}"
    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidBatchFile(f"{where} is not JSON: {exc}", param=where) from None
    if not isinstance(item, dict):
        raise InvalidBatchFile(f"{where} is not a JSON object", param=where)
    custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id:
        raise InvalidBatchFile(f"{where}: custom_id must be a non-empty string", param=where)
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
        raise InvalidBatchFile(f"{where}: body must be an object naming its model", param=where)
    if body.get("stream"):
        raise InvalidBatchFile(f"{where}: a batch line cannot stream", param=where)
    return BatchLine(n, custom_id, url, body["model"], orjson.dumps(body))


def scan_batch(f: IO[bytes], endpoint: str | None = None, max_requests: int | None = None
               ) -> Iterator[Entry]:
    """The requests of a batch input, checked one line at a time (a bad one is a 400 naming its
    number). With `endpoint`, every line must call it (a batch runs one endpoint). A repeated
    custom_id is found from the ids' hashes: a few bytes a line, never the lines."""
    seen: set[int] = set()
    offset, count = 0, 0
    for n, raw in enumerate(f, start=1):
        line = parse_line(raw, n, endpoint)
        start, offset = offset, offset + len(raw)
        if line is None:
            continue
        key = hash(line.custom_id)
        if key in seen:
            raise InvalidBatchFile(f"line {n}: custom_id {line.custom_id!r} appears twice; "
                                   "each line needs its own", param=f"line {n}")
        seen.add(key)
        count += 1
        if max_requests is not None and count > max_requests:
            raise InvalidBatchFile(f"the file holds over {max_requests} requests "
                                   "(batch_max_requests): split it", param=f"line {n}")
        yield Entry(n, start, line.custom_id, line.model)
    if not count:
        raise InvalidBatchFile("the file holds no request (one JSON object per line)")


def read_line(fd: int, offset: int, line_no: int) -> BatchLine:
    """Line `line_no` of a checked input open as `fd`, read back from its `offset` when it runs
    (pread: several lines may be read at once from threads)."""
    chunks: list[bytes] = []
    while chunk := os.pread(fd, 64 * 1024, offset):
        cut = chunk.find(b"\n")
        if cut >= 0:
            chunks.append(chunk[:cut + 1])
            break
        chunks.append(chunk)
        offset += len(chunk)
    line = parse_line(b"".join(chunks), line_no, None)
    if line is None:
        raise InvalidBatchFile(f"line {line_no} changed since the batch was checked",
                               param=f"line {line_no}")
    return line


class Upload:
    """A file being written as its bytes arrive: the owner's only from its first byte, removed
    unless `commit` records it. `write` refuses what would take the file over `files_max_bytes`
    or its owner over `files_max_total_bytes_per_owner`, and a full disk (507)."""

    def __init__(self, store: FileStore, owner: str) -> None:
        self.store = store
        self.owner = owner
        self.id = new_id("file")
        self.size = 0
        self.held = store.held_bytes(owner)
        self._out: IO[bytes] | None = None
        with disk_full_is_507():
            self._out = os.fdopen(store.create_empty(self.id), "wb")

    def write(self, data: bytes) -> None:
        self.size += len(data)
        self.store.check_room(self.owner, self.size, self.held)
        assert self._out is not None
        with disk_full_is_507():
            self._out.write(data)

    def commit(self, purpose: str, filename: str) -> dict[str, Any]:
        """Check it is a batch input when it says it is one, and record it."""
        self.close()
        if purpose == "batch":
            self.store.check_batch(self.id)
        row = {"id": self.id, "owner": self.owner, "purpose": purpose, "filename": filename,
               "size_bytes": self.size, "created_at": time.time()}
        with self.store.db.begin() as conn:
            # Again, in the transaction: two uploads of one owner at once cannot both pass.
            self.store.check_room(self.owner, self.size, self.store.held_bytes(self.owner, conn))
            conn.execute(db.files.insert().values(**row))
        self._out = None
        return row

    def close(self) -> None:
        if self._out is not None and not self._out.closed:
            with disk_full_is_507():  # the last buffered bytes may not fit
                self._out.close()

    def discard(self) -> None:
        """A refused or broken upload leaves nothing behind."""
        if self._out is not None:
            self._out.close()
        self.store.path(self.id).unlink(missing_ok=True)


class FileStore:
    def __init__(self, database: sa.Engine, root: Path, max_bytes: int, *,
                 max_total_bytes_per_owner: int | None = None,
                 max_requests: int | None = None) -> None:
        self.db = database
        self.root = root
        self.max_bytes = max_bytes
        self.max_total_bytes_per_owner = max_total_bytes_per_owner
        self.max_requests = max_requests

    def path(self, file_id: str) -> Path:
        if "/" in file_id or file_id.startswith("."):
            raise FileNotFound(file_id)
        return self.root / file_id

    def create_empty(self, file_id: str) -> int:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        return os.open(self.path(file_id), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)

    def held_bytes(self, owner: str, conn: sa.Connection | None = None) -> int:
        """What `owner`'s files (uploads and batch outputs) take on disk."""
        q = sa.select(sa.func.coalesce(sa.func.sum(db.files.c.size_bytes), 0)) \
            .where(db.files.c.owner == owner)
        if conn is not None:
            return int(conn.execute(q).scalar_one())
        with self.db.connect() as c:
            return int(c.execute(q).scalar_one())

    def check_room(self, owner: str, size: int, held: int) -> None:
        if size > self.max_bytes:
            raise PayloadTooLarge(f"the file is over {self.max_bytes} bytes (files_max_bytes)")
        quota = self.max_total_bytes_per_owner
        if quota is not None and held + size > quota:
            raise FilesOverQuota(
                f"your files take {held} bytes and this one {size} more: over "
                f"files_max_total_bytes_per_owner ({quota}); delete some (DELETE /v1/files/"
                "{file_id}, outputs of finished batches included) and upload again")

    def upload(self, owner: str) -> Upload:
        return Upload(self, owner)

    def save(self, owner: str, purpose: str, filename: str, source: IO[bytes]) -> dict[str, Any]:
        """Copy a whole stream in, as an upload does (at most `max_bytes`)."""
        upload = self.upload(owner)
        try:
            while chunk := source.read(_COPY_CHUNK):
                upload.write(chunk)
            return upload.commit(purpose, filename)
        except BaseException:
            upload.discard()
            raise

    def new_output(self, file_id: str, owner: str, filename: str) -> None:
        """An empty output (or error) file of a batch, appended to as lines finish."""
        os.close(self.create_empty(file_id))
        with self.db.begin() as conn:
            conn.execute(db.files.insert().values(
                id=file_id, owner=owner, purpose="batch_output", filename=filename,
                size_bytes=0, created_at=time.time()))

    def sync_size(self, file_id: str) -> None:
        size = self.path(file_id).stat().st_size
        with self.db.begin() as conn:
            conn.execute(db.files.update().where(db.files.c.id == file_id)
                         .values(size_bytes=size))

    def check_batch(self, file_id: str, endpoint: str | None = None) -> int:
        """How many requests a batch input holds, once each line is checked (400 otherwise)."""
        with self.path(file_id).open("rb") as f:
            return sum(1 for _ in scan_batch(f, endpoint, self.max_requests))

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
