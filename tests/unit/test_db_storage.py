"""The database layer (src/modelyard/db.py) on real SQLite files: a full database is the 507
InsufficientStorage, rendered in each API's shape, never the driver's text in a 500; damaged files
are named before anything touches them; a backup is a consistent, owner-only copy."""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path
from typing import Any

import orjson
import pytest
import sqlalchemy as sa

from modelyard import db
from modelyard.errors import InsufficientStorage
from modelyard.front.render import error_response

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def full_database(tmp_path: Path) -> sa.Engine:
    """A database that cannot grow by a page: SQLite's own limit, what a full disk looks like
    to it (SQLITE_FULL)."""
    engine = db.connect(f"sqlite:///{tmp_path / 'modelyard.db'}")
    engine.dispose()  # connections made from now on get the limit

    def no_more_pages(dbapi_connection: Any, _record: Any) -> None:
        pages = dbapi_connection.execute("PRAGMA page_count").fetchone()[0]
        dbapi_connection.execute(f"PRAGMA max_page_count={pages}")

    sa.event.listen(engine, "connect", no_more_pages)
    return engine


def test_a_full_database_raises_insufficient_storage(tmp_path: Path) -> None:
    engine = full_database(tmp_path)
    with pytest.raises(InsufficientStorage) as raised, engine.begin() as conn:
        conn.execute(db.aliases.insert().values(name="big", model="x" * 100_000))
    assert "database or disk is full" not in raised.value.message  # ours, not the driver's
    assert "disk holding the database is full" in raised.value.message
    with engine.connect() as conn:  # nothing of it was written
        assert conn.execute(sa.select(db.aliases)).fetchall() == []


@pytest.mark.parametrize(("path", "code"), [
    ("/v1/chat/completions", lambda b: b["error"]["code"]),
    ("/api/pull", lambda b: b["error"]),
    ("/auth/login", lambda b: b["error"]),
])
def test_insufficient_storage_renders_507_in_each_api_shape(path: str, code: Any) -> None:
    response = error_response(path, InsufficientStorage("the disk is full"))
    assert response.status_code == 507
    body = orjson.loads(bytes(response.body))
    expected = "the disk is full" if path.startswith("/api/") else "insufficient_storage"
    assert code(body) == expected


def test_check_names_an_empty_a_foreign_and_a_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "modelyard.db"
    url = f"sqlite:///{path}"
    db.check(url)  # no file: a first boot
    engine = db.connect(url)
    with engine.begin() as conn:
        for i in range(100):
            conn.execute(db.aliases.insert().values(name=f"a{i}", model="m" * 1000))
    engine.dispose()
    whole = path.read_bytes()
    for content, what in [(b"", "is empty (0 bytes)"), (b"<html>" * 50, "not a SQLite database"),
                          (whole[: len(whole) // 2], "is truncated")]:
        path.write_bytes(content)
        with pytest.raises(db.DatabaseDamaged, match=re.escape(what)):
            db.check(url)
    path.write_bytes(whole)
    db.check(url)


def test_backup_is_a_consistent_owner_only_copy(tmp_path: Path) -> None:
    path = tmp_path / "modelyard.db"
    engine = db.connect(f"sqlite:///{path}")
    with engine.begin() as conn:  # still in the WAL, not yet in the main file
        conn.execute(db.aliases.insert().values(name="kept", model="m"))
    old = os.umask(0o022)
    try:
        copy = db.backup(path)
    finally:
        os.umask(old)
    assert copy.stat().st_mode & 0o777 == 0o600
    with sqlite3.connect(copy) as conn:
        assert conn.execute("SELECT name FROM aliases").fetchall() == [("kept",)]
    conn.close()
    engine.dispose()
    assert db.backup(path) != copy  # a second one (same second even) never overwrites the first
