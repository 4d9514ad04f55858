"""Chat sessions in the SQLite table `chat_sessions` (`chat_session_persist`): rows written
behind by the store's one writer task, and read back at start."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from modelyard import db

Key = tuple[str, str]  # (owner, session id)


def write(engine: sa.Engine, batch: list[tuple[Key, dict[str, Any] | None]]) -> None:
    """Each session's row replaced by its new one (None: the session is gone), in one
    transaction."""
    table = db.chat_sessions
    with engine.begin() as conn:
        for (owner, sid), row in batch:
            conn.execute(table.delete().where(table.c.owner == owner, table.c.id == sid))
            if row is not None:
                conn.execute(table.insert().values(**row))


def load(engine: sa.Engine, *, expired_before: float) -> list[dict[str, Any]]:
    """Every stored row, after deleting those last used before `expired_before`."""
    table = db.chat_sessions
    with engine.begin() as conn:
        conn.execute(table.delete().where(table.c.last_used_at < expired_before))
        return db.rows(conn.execute(sa.select(table)))
