"""Chat sessions in the table `chat_sessions` (`chat_session_persist`): rows written
behind by the store's one writer task, and read back at start."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from modelyard import db

Key = tuple[str, str]  # (owner, session id)
# One session's change: its new row, or (it is gone) the turns it had: its row is deleted
# unless another front (on a shared database) has answered more turns since.
Change = tuple[Key, dict[str, Any] | int]
ALL_TURNS = 2**62  # a session gone whatever its turns


def write(engine: sa.Engine, batch: list[Change]) -> None:
    """Each session's row replaced by its new one, or deleted, in one transaction. A row with
    more turns than ours stays: another front answered a later turn, and our copy is stale."""
    table = db.chat_sessions
    with engine.begin() as conn:
        for (owner, sid), row in batch:
            mine = sa.and_(table.c.owner == owner, table.c.id == sid)
            if isinstance(row, int):
                conn.execute(table.delete().where(mine, table.c.turns <= row))
                continue
            conn.execute(table.delete().where(mine, table.c.turns <= row["turns"]))
            if conn.execute(sa.select(table.c.turns).where(mine)).first() is None:
                conn.execute(table.insert().values(**row))


def load_one(engine: sa.Engine, owner: str, session_id: str) -> dict[str, Any] | None:
    table = db.chat_sessions
    with engine.connect() as conn:
        found = db.rows(conn.execute(sa.select(table).where(
            table.c.owner == owner, table.c.id == session_id)))
    return found[0] if found else None


def load_owned(engine: sa.Engine, owner: str | None) -> list[dict[str, Any]]:
    """Every row of `owner` (None: of every owner)."""
    table = db.chat_sessions
    query = sa.select(table) if owner is None else sa.select(table).where(table.c.owner == owner)
    with engine.connect() as conn:
        return db.rows(conn.execute(query))


def load(engine: sa.Engine, *, expired_before: float) -> list[dict[str, Any]]:
    """Every stored row, after deleting those last used before `expired_before`."""
    table = db.chat_sessions
    with engine.begin() as conn:
        conn.execute(table.delete().where(table.c.last_used_at < expired_before))
        return db.rows(conn.execute(sa.select(table)))
