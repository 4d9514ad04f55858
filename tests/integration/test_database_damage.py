"""A damaged database stops `modelyard serve` with one line that says what and how to fix it (no
first boot over it, no traceback); `modelyard db reset` moves it aside on purpose; a schema
change is preceded by a backup (src/modelyard/db.py, src/modelyard/cli/db.py). Real processes."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from tests.integration.harness import config
from tests.support import Server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def refused(home: Path) -> str:
    """Start a server on `home`, expect it to refuse; its whole output."""
    server = Server(home, config())
    try:
        rc = server.proc.wait(60)
    finally:
        server.stop()
    output = server.output()
    assert rc not in (0, None), output
    return output


def assert_one_clear_line(output: str, db_file: Path, what: str) -> None:
    assert "Traceback" not in output
    lines = output.strip().splitlines()
    assert len(lines) == 1, output
    assert what in lines[0] and str(db_file) in lines[0]
    assert "restore it from a backup" in lines[0] and "`modelyard db reset`" in lines[0]


def first_boot_database(tmp_path: Path) -> Path:
    """A home whose database a real server made (first boot: the admin user and token)."""
    home = tmp_path / "home"
    server = Server(home, config())
    try:
        server.wait_healthy()
    finally:
        server.stop()
    return home / "modelyard.db"


def test_an_empty_database_file_is_refused_not_taken_for_a_first_boot(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    db_file = home / "modelyard.db"
    db_file.write_bytes(b"")
    assert_one_clear_line(refused(home), db_file, "is empty (0 bytes)")
    assert db_file.stat().st_size == 0  # left as it was: nothing created over it


def test_a_truncated_database_is_refused_in_one_line(tmp_path: Path) -> None:
    db_file = first_boot_database(tmp_path)
    data = db_file.read_bytes()
    db_file.write_bytes(data[: len(data) // 2])
    assert_one_clear_line(refused(db_file.parent), db_file, "is truncated")


def test_db_reset_moves_the_database_aside_and_the_next_start_is_a_first_boot(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    db_file = home / "modelyard.db"
    db_file.write_bytes(b"not a database at all")
    env = {**os.environ, "MODELYARD_HOME": str(home)}
    done = subprocess.run([sys.executable, "-m", "modelyard", "db", "reset", "--yes"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    moved = list(home.glob("modelyard.db.reset-*"))
    assert len(moved) == 1 and moved[0].read_bytes() == b"not a database at all"
    assert not db_file.exists()
    server = Server(home, config())
    try:
        server.wait_healthy()
        assert (home / "cli-token").is_file()  # first boot made the admin and its CLI token
    finally:
        server.stop()


def test_a_schema_change_is_preceded_by_a_backup(tmp_path: Path) -> None:
    db_file = first_boot_database(tmp_path)
    with sqlite3.connect(db_file) as conn:  # as a version without chat sessions left it
        conn.execute("DROP TABLE chat_sessions")
        users = conn.execute("SELECT name FROM users").fetchall()
    conn.close()
    server = Server(db_file.parent, config())
    try:
        server.wait_healthy()
    finally:
        server.stop()
    backups = list(db_file.parent.glob("modelyard.db.backup-*"))
    assert len(backups) == 1
    assert backups[0].stat().st_mode & 0o777 == 0o600
    with sqlite3.connect(backups[0]) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        assert conn.execute("SELECT name FROM users").fetchall() == users
    conn.close()
    assert "users" in tables and "chat_sessions" not in tables  # the state before the change
    with sqlite3.connect(db_file) as conn:
        assert conn.execute("SELECT count(*) FROM chat_sessions").fetchone() == (0,)
    conn.close()
