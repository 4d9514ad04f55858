"""Several fronts on one database: what each front does so that the others see its work.

Fronts share nothing but the database (PostgreSQL) and `shared_dir` (the cookie key, the
archive's files). Each front has a stable id (`front_id`, kept in its $home so a restarted front
knows its own earlier claims), and one background task that, every `front_sync_interval_s`:

* renews the claims on the pull jobs it owns (front/ops/jobs.py `heartbeat`): a front starting
  elsewhere takes a job for a dead front's only once its claim is stale;
* reads the `config` epoch (db.front_epochs): a front that reloaded its config bumps it (an
  atomic `epoch = epoch + 1` in the database), every other front sees it move and reloads its
  own config file too. One poll per interval, also on SQLite, where it costs one small read.

Decisions that must hold for all fronts are the database's (conditional UPDATEs), never one
front's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import sqlalchemy as sa

from modelyard import db
from modelyard.errors import ModelyardError

log = logging.getLogger("modelyard.fronts")

CONFIG = "config"
FRONT_ID_FILE = "front-id"
PEER_RELOAD = "another front reloaded the config"


def front_id(home: Path) -> str:
    """This front's id: `<host>-<random>`, made once per $MODELYARD_HOME (two fronts must not
    share a home)."""
    path = home / FRONT_ID_FILE
    with contextlib.suppress(FileNotFoundError):
        if found := path.read_text().strip():
            return found
    made = f"{socket.gethostname()[:40]}-{secrets.token_hex(6)}"
    home.mkdir(parents=True, exist_ok=True)
    path.write_text(made + "\n")
    return made


def read_epoch(engine: sa.Engine, name: str = CONFIG) -> int:
    with engine.connect() as conn:
        found = conn.execute(sa.select(db.front_epochs.c.epoch)
                             .where(db.front_epochs.c.name == name)).scalar()
    return int(found or 0)


def bump_epoch(engine: sa.Engine, by: str, name: str = CONFIG) -> int:
    """Add one to the epoch in the database (atomic on every front); the new value."""
    table = db.front_epochs
    for _ in range(3):
        try:
            with engine.begin() as conn:
                done = conn.execute(sa.update(table).where(table.c.name == name).values(
                    epoch=table.c.epoch + 1, updated_by=by, updated_at=time.time())).rowcount
                if not done:  # the first bump ever: two fronts racing here, one insert wins
                    conn.execute(sa.insert(table).values(
                        name=name, epoch=1, updated_by=by, updated_at=time.time()))
            return read_epoch(engine, name)
        except sa.exc.IntegrityError:
            continue
    raise RuntimeError(f"could not bump the {name} epoch")


Heartbeat = Callable[[], Awaitable[None]]
Reload = Callable[[str], Awaitable[object]]


class FrontSync:
    """The background task of one front among several (see the module's doc)."""

    def __init__(self, engine: sa.Engine, front: str, interval_s: float, *,
                 heartbeat: Heartbeat, reload: Reload) -> None:
        self.db = engine
        self.front = front
        self.interval_s = interval_s
        self._heartbeat = heartbeat
        self._reload = reload
        self.seen = 0  # the config epoch this front's config is up to date with
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.seen = await asyncio.to_thread(read_epoch, self.db)
        self._task = asyncio.create_task(self._run(), name="front-sync")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def announce_reload(self) -> None:
        """This front reloaded its config: the others follow."""
        self.seen = await asyncio.to_thread(bump_epoch, self.db, self.front)

    async def tick(self) -> None:
        """One round: renew claims, follow another front's reload."""
        await self._heartbeat()
        epoch = await asyncio.to_thread(read_epoch, self.db)
        if epoch > self.seen:
            self.seen = epoch
            # A refused file is logged by the reloader; this front keeps its config in force.
            with contextlib.suppress(ModelyardError):
                await self._reload(PEER_RELOAD)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a database hiccup: the next round tries again
                log.exception("front sync failed")
