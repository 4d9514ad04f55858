"""The archive: generated files and transcripts, kept for a retention, seen only by their owner.

An item is a row of `db.archive` plus one file, $MODELYARD_HOME/archive/<id>. The id is 128 random
bits made here, so no path is ever built from what a client sent: a lookup checks the id's shape,
then reads the row, then opens root/<the row's id>. The download name is sanitized separately and
only ever travels in Content-Disposition. The file is written before its row and deleted after
it, so a crash leaves at most an orphan file, which the next start removes.

Visibility: an owner sees their own items, admins see all; anonymous items (owner None: loopback
without auth) only admins. An item not yours is "not found", never "forbidden", so ids of other
users' items cannot be probed. An expired item is gone even before the sweeper deletes it; the
sweeper wakes at the next expiry (and every `archive_sweep_interval_s` at least).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mimetypes
import os
import re
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import sqlalchemy as sa

from modelyard import db
from modelyard.config import ArchiveRetention, Settings
from modelyard.errors import ArchiveItemNotFound, InvalidRequest
from modelyard.front.identity.principal import Principal

log = logging.getLogger("modelyard.archive")
SHARED_ORPHAN_AGE_S = 600.0  # `shared_dir`: a file without a row this long is no save in progress

DAY_S = 86400.0
RETENTION_S: dict[str, float | None] = {
    "1h": 3600.0, "1d": DAY_S, "1w": 7 * DAY_S, "1m": 30 * DAY_S, "1y": 365 * DAY_S,
    "never": None,
}
assert set(RETENTION_S) == set(get_args(ArchiveRetention))
KINDS = ("chat", "image", "speech", "transcription", "activity")  # activity: captured bodies
MAX_LIST = 500
_ID = re.compile(r"[0-9a-f]{32}")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_NAME = 120
# Where mimetypes has no answer, or a poor one (.jpe, .bin).
_EXTENSIONS = {
    "application/json": ".json", "text/plain": ".txt", "text/markdown": ".md",
    "audio/wav": ".wav", "audio/x-wav": ".wav", "audio/wave": ".wav", "audio/mpeg": ".mp3",
    "audio/ogg": ".ogg", "audio/opus": ".opus", "audio/flac": ".flac", "audio/aac": ".aac",
    "audio/pcm": ".pcm", "image/png": ".png", "image/jpeg": ".jpg", "image/webp": ".webp",
    "image/gif": ".gif",
}


def parse_retention(value: object, param: str) -> str:
    """`1h|1d|1w|1m|1y|never` (any case); anything else is a 400 naming `param`."""
    if isinstance(value, str) and value.strip().lower() in RETENTION_S:
        return value.strip().lower()
    raise InvalidRequest(
        f"{param}: {value!r} is not a retention; use one of 1h, 1d, 1w, 1m (30 days), "
        "1y (365 days) or never", param=param)


def effective_retention(requested: str | None, principal: Principal, default: str) -> str:
    """The request's retention, else its token's or user's default, else the server's."""
    return requested or principal.archive_retention or default


def expires_at(retention: str, created_at: float) -> float | None:
    seconds = RETENTION_S[retention]
    return None if seconds is None else created_at + seconds


def is_item_id(value: str) -> bool:
    return _ID.fullmatch(value) is not None


def safe_filename(name: str, fallback: str = "item") -> str:
    """A download name that is one plain ASCII path component: no directories, no leading dot,
    no quotes or control characters (it goes into a header), at most 120 characters."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    cleaned = _UNSAFE.sub("_", base).strip("._-")
    if len(cleaned) > _MAX_NAME:
        stem, dot, ext = cleaned.rpartition(".")
        keep = f".{ext}" if dot and stem and len(ext) <= 10 else ""
        cleaned = cleaned[: _MAX_NAME - len(keep)].rstrip("._-") + keep
    return cleaned or fallback


def extension_for(media_type: str) -> str:
    bare = media_type.split(";", 1)[0].strip().lower()
    return _EXTENSIONS.get(bare) or mimetypes.guess_extension(bare) or ".bin"


@dataclass(frozen=True)
class NewItem:
    """What to archive: the bytes and how to describe them (the filename is sanitized here)."""

    kind: str
    data: bytes
    media_type: str
    filename: str
    model: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def _view(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in ("id", "owner", "kind", "model", "filename", "media_type",
                                "size_bytes", "retention", "created_at", "expires_at", "meta")}


def new_item_id() -> str:
    """128 random bits: ids never come from user input, so they name no path."""
    return secrets.token_hex(16)


class ArchiveStore:
    """The archive's rows and files, its background saves and its sweeper.

    Methods are async (the database and disk work runs in a thread); `spawn` runs a save after
    a response has gone, so archiving never delays a client.
    """

    def __init__(
        self,
        database: sa.Engine,
        root: Path,
        *,
        default_retention: str = "1w",
        sweep_interval_s: float = 300.0,
        clock: Callable[[], float] = time.time,
        orphan_min_age_s: float = 0.0,
    ) -> None:
        self.db = database
        self.root = root
        # With several fronts on one shared directory, a file without its row may be another
        # front's save in progress (file first, row after): only older files are orphans.
        self.orphan_min_age_s = orphan_min_age_s
        self.default_retention = default_retention
        self.sweep_interval_s = sweep_interval_s
        self.clock = clock
        self._pending: set[asyncio.Task[Any]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._wake_at = float("inf")
        self._pass_done = asyncio.Event()

    @classmethod
    def for_settings(cls, settings: Settings, database: sa.Engine) -> ArchiveStore:
        return cls(database, settings.shared_path / "archive",
                   default_retention=settings.archive_retention,
                   sweep_interval_s=settings.archive_sweep_interval_s,
                   orphan_min_age_s=SHARED_ORPHAN_AGE_S if settings.shared_dir else 0.0)

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the directory, drop orphan files, and start the sweeper (its first pass
        deletes what expired while the server was down)."""
        removed = await asyncio.to_thread(self._prepare)
        if removed:
            log.info("archive: removed %d orphan file(s)", removed)
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="archive-sweeper")

    async def stop(self) -> None:
        """Stop the sweeper and let saves in progress finish (bounded)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._pending:
            _done, late = await asyncio.wait(set(self._pending), timeout=30.0)
            for task in late:
                task.cancel()

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run `work` (a save) in the background; a failure is logged, never raised."""
        task = asyncio.ensure_future(work)
        self._pending.add(task)
        task.add_done_callback(self._saved)

    def _saved(self, task: asyncio.Task[Any]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("archive: saving an item failed: %r", task.exception())

    async def idle(self) -> None:
        """Wait until the background saves started so far are done (for tests and shutdown)."""
        while self._pending:
            await asyncio.wait(set(self._pending))

    # ---- items ----------------------------------------------------------------------------

    async def save(self, owner: str | None, retention: str, item: NewItem,
                   item_id: str | None = None) -> dict[str, Any]:
        """Stores `item`; `item_id` is one `new_item_id()` made earlier (to announce it)."""
        row = await asyncio.to_thread(self._save, owner, retention, item, item_id)
        expiry = row["expires_at"]
        if expiry is not None and expiry < self._wake_at:
            self._wake.set()  # the sweeper sleeps past this item's expiry: reschedule it
        return row

    async def list_items(
        self,
        principal: Principal,
        *,
        kind: str | None = None,
        limit: int = 100,
        before: float | None = None,
        owner: str | None = None,
    ) -> list[dict[str, Any]]:
        """Newest first; `before`: only items created earlier (pagination by created_at)."""
        return await asyncio.to_thread(self._list, principal, kind, limit, before, owner)

    async def get(self, principal: Principal, item_id: str) -> dict[str, Any]:
        return await asyncio.to_thread(self._get, principal, item_id)

    async def content(self, principal: Principal, item_id: str) -> tuple[dict[str, Any], Path]:
        """The item and its file (which exists when this returns)."""
        return await asyncio.to_thread(self._content, principal, item_id)

    async def delete(self, principal: Principal, item_id: str) -> None:
        await asyncio.to_thread(self._delete, principal, item_id)

    async def sweep(self) -> int:
        """Delete the items that have expired; how many."""
        return await asyncio.to_thread(self._sweep)

    # ---- the sweeper ----------------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    async def next_pass(self) -> None:
        """Returns after the sweeper's next pass (one that had not finished when called)."""
        await self._pass_done.wait()

    async def _sweep_forever(self) -> None:
        while True:
            self._wake.clear()  # a save after this point wakes the wait below at once
            delay = self.sweep_interval_s
            try:
                removed = await self.sweep()
                if removed:
                    log.info("archive: %d expired item(s) deleted", removed)
                upcoming = await asyncio.to_thread(self._next_expiry)
                if upcoming is not None:
                    delay = min(delay, max(0.0, upcoming - self.clock()))
            except Exception:
                log.exception("archive: the sweep failed; retrying in %.0f s", delay)
            done, self._pass_done = self._pass_done, asyncio.Event()
            done.set()
            self._wake_at = self.clock() + delay
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    # ---- blocking work (in a thread) ------------------------------------------------------

    def _path(self, item_id: str) -> Path:
        assert is_item_id(item_id)  # ids are made here; a row can hold nothing else
        return self.root / item_id

    def _prepare(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        with self.db.connect() as conn:
            known = set(conn.execute(sa.select(db.archive.c.id)).scalars())
        removed = 0
        for path in self.root.iterdir():
            name = path.name
            ours = is_item_id(name) or (name.endswith(".tmp") and is_item_id(name[:-4]))
            if ours and name not in known and path.is_file() and (
                    not self.orphan_min_age_s
                    or time.time() - path.stat().st_mtime > self.orphan_min_age_s):
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def _save(self, owner: str | None, retention: str, item: NewItem,
              item_id: str | None) -> dict[str, Any]:
        if item.kind not in KINDS:
            raise ValueError(f"unknown archive kind {item.kind!r}")
        retention = parse_retention(retention, "archive")
        item_id = item_id or new_item_id()
        now = self.clock()
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self._path(item_id)
        partial = path.with_name(item_id + ".tmp")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(item.data)
        partial.replace(path)
        fallback = item.kind + extension_for(item.media_type)
        row = {
            "id": item_id, "owner": owner, "kind": item.kind, "model": item.model,
            "filename": safe_filename(item.filename, fallback),
            "media_type": item.media_type, "size_bytes": len(item.data), "retention": retention,
            "created_at": now, "expires_at": expires_at(retention, now), "meta": item.meta,
        }
        try:
            with self.db.begin() as conn:
                conn.execute(sa.insert(db.archive).values(**row))
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return _view(row)

    def _list(self, principal: Principal, kind: str | None, limit: int, before: float | None,
              owner: str | None) -> list[dict[str, Any]]:
        t = db.archive
        query = sa.select(t).where(self._visible(principal))
        if kind is not None:
            query = query.where(t.c.kind == kind)
        if before is not None:
            query = query.where(t.c.created_at < before)
        if owner is not None:
            query = query.where(t.c.owner == owner)
        query = query.order_by(t.c.created_at.desc(), t.c.id.desc()).limit(limit)
        with self.db.connect() as conn:
            return [_view(r) for r in db.rows(conn.execute(query))]

    def _visible(self, principal: Principal) -> sa.ColumnElement[bool]:
        """Items `principal` may see that have not expired."""
        t = db.archive
        alive = sa.or_(t.c.expires_at.is_(None), t.c.expires_at > self.clock())
        if principal.is_admin:
            return alive
        if principal.user is None:
            return sa.false()
        return sa.and_(alive, t.c.owner == principal.user)

    def _get(self, principal: Principal, item_id: str) -> dict[str, Any]:
        if not is_item_id(item_id):
            raise ArchiveItemNotFound(item_id[:64])
        query = sa.select(db.archive).where(db.archive.c.id == item_id, self._visible(principal))
        with self.db.connect() as conn:
            found = db.rows(conn.execute(query))
        if not found:
            raise ArchiveItemNotFound(item_id)
        return _view(found[0])

    def _content(self, principal: Principal, item_id: str) -> tuple[dict[str, Any], Path]:
        item = self._get(principal, item_id)
        path = self._path(item["id"])
        if not path.is_file():  # deleted meanwhile
            raise ArchiveItemNotFound(item_id)
        return item, path

    def _delete(self, principal: Principal, item_id: str) -> None:
        item = self._get(principal, item_id)
        with self.db.begin() as conn:
            conn.execute(sa.delete(db.archive).where(db.archive.c.id == item["id"]))
        self._path(item["id"]).unlink(missing_ok=True)

    def _sweep(self) -> int:
        t = db.archive
        now = self.clock()
        removed = 0
        while True:
            with self.db.begin() as conn:
                ids = list(conn.execute(
                    sa.select(t.c.id).where(t.c.expires_at <= now).limit(1000)).scalars())
                if not ids:
                    return removed
                conn.execute(sa.delete(t).where(t.c.id.in_(ids)))
            for item_id in ids:
                if is_item_id(item_id):
                    self._path(item_id).unlink(missing_ok=True)
            removed += len(ids)

    def _next_expiry(self) -> float | None:
        with self.db.connect() as conn:
            value = conn.execute(sa.select(sa.func.min(db.archive.c.expires_at))).scalar()
        return None if value is None else float(value)
