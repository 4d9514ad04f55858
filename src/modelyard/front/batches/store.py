"""The `batches` table: the batch object, its status, its counters, and which front runs it.

Everything several fronts must agree on is decided by the database: a front claims a batch with
a conditional UPDATE (unclaimed, or its claim's lease expired), renews the lease while it runs
it, and counters are incremented in SQL. Every status change is conditional too
(`transition`: UPDATE … WHERE status IN (what the writer expects)): a cancel and the runner
racing each other cannot both win, and the loser learns it lost and reads what happened.
Blocking calls: the async side uses `asyncio.to_thread`.
"""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa

from modelyard import db
from modelyard.front.batches.errors import BatchFinished, BatchNotFound, TooManyOpenBatches
from modelyard.front.batches.files import new_id, visible
from modelyard.front.identity.principal import Principal, owner_key

WINDOW_S = {"24h": 24 * 3600.0}
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # a runner's to carry on
CANCELLABLE = ("validating", "in_progress", "finalizing")
FINAL = ("completed", "failed", "expired", "cancelled")
_STAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
           "cancelling_at", "cancelled_at")


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's batch object."""
    stamps = {k: None if row[k] is None else int(row[k]) for k in _STAMPS}
    return {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"],
        "errors": row["errors"], "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"], "status": row["status"],
        "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
        "created_at": int(row["created_at"]), "expires_at": int(row["expires_at"]), **stamps,
        "request_counts": {"total": row["total"], "completed": row["completed"],
                           "failed": row["failed"]},
        "metadata": row["meta"],
        # Not in OpenAI's object (clients ignore it): whose batch it is, for an admin's list
        # (the Studio's Batches page); "" is anonymous callers'.
        "owner": row["owner"],
    }


class BatchStore:
    def __init__(self, database: sa.Engine, *, max_open_per_owner: int | None = None) -> None:
        self.db = database
        self.max_open_per_owner = max_open_per_owner

    def check_open(self, owner: str) -> None:
        """An owner runs at most `max_open_per_owner` batches at once (429 beyond: one ending
        frees a place)."""
        if self.max_open_per_owner is None:
            return
        with self.db.connect() as conn:
            n = conn.execute(sa.select(sa.func.count()).select_from(db.batches).where(
                db.batches.c.owner == owner, db.batches.c.status.in_(ACTIVE))).scalar_one()
        if n >= self.max_open_per_owner:
            raise TooManyOpenBatches(
                f"you have {n} batches not yet ended: batches_max_open_per_owner is "
                f"{self.max_open_per_owner}; wait for one to end (or cancel one) and create "
                "this one again", retry_after_s=60.0)

    def create(self, principal: Principal, *, endpoint: str, input_file_id: str, window: str,
               meta: dict[str, str] | None, total: int, output_file_id: str,
               error_file_id: str) -> dict[str, Any]:
        now = time.time()
        row = {"id": new_id("batch"), "owner": owner_key(principal),
               "owner_group": principal.group, "token_id": principal.token_id,
               "endpoint": endpoint, "input_file_id": input_file_id,
               "completion_window": window, "status": "validating", "meta": meta,
               "errors": None, "output_file_id": output_file_id,
               "error_file_id": error_file_id, "total": total, "completed": 0, "failed": 0,
               "created_at": now, "expires_at": now + WINDOW_S[window],
               **dict.fromkeys(_STAMPS), "claimed_by": None, "lease_until": None}
        with self.db.begin() as conn:
            conn.execute(db.batches.insert().values(**row))
        return row

    def get(self, batch_id: str, principal: Principal | None = None) -> dict[str, Any]:
        with self.db.connect() as conn:
            row = conn.execute(sa.select(db.batches).where(db.batches.c.id == batch_id)).first()
        if row is None or (principal is not None and not visible(principal, row.owner)):
            raise BatchNotFound(batch_id)
        return dict(row._mapping)

    def list_batches(self, principal: Principal, limit: int,
                     after: str | None) -> list[dict[str, Any]]:
        q = sa.select(db.batches).order_by(db.batches.c.created_at.desc(),
                                           db.batches.c.id.desc())
        if not principal.is_admin:
            q = q.where(db.batches.c.owner == owner_key(principal))
        if after:
            mark = self.get(after, principal)
            q = q.where(sa.or_(db.batches.c.created_at < mark["created_at"],
                               sa.and_(db.batches.c.created_at == mark["created_at"],
                                       db.batches.c.id < mark["id"])))
        with self.db.connect() as conn:
            return db.rows(conn.execute(q.limit(limit)))

    def cancel(self, batch_id: str, principal: Principal) -> dict[str, Any]:
        """validating / in_progress / finalizing → cancelling (the front running it finishes
        the lines in flight, then marks it cancelled); a finished batch is a 409."""
        self.get(batch_id, principal)
        changed = self.transition(batch_id, CANCELLABLE, "cancelling",
                                  cancelling_at=time.time())
        row = self.get(batch_id)
        if not changed and row["status"] != "cancelling":
            raise BatchFinished(f"batch {batch_id} is {row['status']}: nothing to cancel")
        return row

    # ---- the runner's side ----------------------------------------------------------------

    def claim(self, front_id: str, lease_s: float) -> list[dict[str, Any]]:
        """Take every active batch nobody holds (or whose holder's lease ran out): one
        conditional UPDATE per batch, so with several fronts exactly one wins each."""
        now = time.time()
        free = sa.or_(db.batches.c.claimed_by.is_(None), db.batches.c.lease_until < now)
        with self.db.connect() as conn:
            ids = [r.id for r in conn.execute(
                sa.select(db.batches.c.id).where(db.batches.c.status.in_(ACTIVE), free)
                .order_by(db.batches.c.created_at))]
        won = []
        for batch_id in ids:
            with self.db.begin() as conn:
                got = conn.execute(
                    db.batches.update()
                    .where(db.batches.c.id == batch_id, db.batches.c.status.in_(ACTIVE), free)
                    .values(claimed_by=front_id, lease_until=now + lease_s)).rowcount
            if got:
                won.append(self.get(batch_id))
        return won

    def renew(self, front_id: str, batch_ids: list[str], lease_s: float) -> set[str]:
        """Extend this front's claims; returns the ids it still holds (and their status is
        read by the caller through `statuses`)."""
        if not batch_ids:
            return set()
        with self.db.begin() as conn:
            conn.execute(db.batches.update()
                         .where(db.batches.c.id.in_(batch_ids),
                                db.batches.c.claimed_by == front_id)
                         .values(lease_until=time.time() + lease_s))
            return {r.id for r in conn.execute(
                sa.select(db.batches.c.id).where(db.batches.c.id.in_(batch_ids),
                                                 db.batches.c.claimed_by == front_id))}

    def statuses(self, batch_ids: list[str]) -> dict[str, str]:
        if not batch_ids:
            return {}
        with self.db.connect() as conn:
            return {r.id: r.status for r in conn.execute(
                sa.select(db.batches.c.id, db.batches.c.status)
                .where(db.batches.c.id.in_(batch_ids)))}

    def release(self, front_id: str) -> None:
        """At shutdown: another front (or this one, restarted) takes them at once."""
        with self.db.begin() as conn:
            conn.execute(db.batches.update().where(db.batches.c.claimed_by == front_id)
                         .values(claimed_by=None, lease_until=None))

    def transition(self, batch_id: str, expected: tuple[str, ...], status: str, *,
                   holder: str | None = None, **values: Any) -> bool:
        """Set `status` (and `values`) if the batch is in one of `expected` (and, with
        `holder`, still claimed by that front): True if this call changed it. False: someone
        else changed it first (a cancel, another front); read it again and act on that."""
        where = [db.batches.c.id == batch_id, db.batches.c.status.in_(expected)]
        if holder is not None:
            where.append(db.batches.c.claimed_by == holder)
        with self.db.begin() as conn:
            return bool(conn.execute(db.batches.update().where(*where)
                                     .values(status=status, **values)).rowcount)

    def update(self, batch_id: str, **values: Any) -> None:
        """Counters and files only: a status goes through `transition`."""
        with self.db.begin() as conn:
            conn.execute(db.batches.update().where(db.batches.c.id == batch_id).values(**values))

    def count(self, batch_id: str, *, ok: bool) -> None:
        column = db.batches.c.completed if ok else db.batches.c.failed
        with self.db.begin() as conn:
            conn.execute(db.batches.update().where(db.batches.c.id == batch_id)
                         .values({column: column + 1}))
