"""modelyard's database: SQLite under MODELYARD_HOME by default, through SQLAlchemy Core;
PostgreSQL (`database_url: postgresql+psycopg://…`) for several fronts sharing one database.
Every query here and in the stores works on both (the store tests run on both).

What must survive a restart lives here: pull jobs, the models pulled and imported, aliases,
users, their sessions and API tokens, and the archive index.
SQLite runs in WAL mode so the front writes while engines read (they list pulled models).
Calls are blocking and short; async callers run them with `asyncio.to_thread`.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from modelyard.errors import InsufficientStorage

log = logging.getLogger(__name__)

metadata = sa.MetaData()

jobs = sa.Table(
    "jobs",
    metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("model", sa.String, nullable=False),  # the reference as the user wrote it
    sa.Column("ref", sa.String, nullable=False, index=True),  # canonical reference
    sa.Column("model_id", sa.String),  # the catalog name it gets
    sa.Column("status", sa.String(16), nullable=False, index=True),
    sa.Column("quantize", sa.String(8), nullable=False),
    sa.Column("init", sa.Boolean, nullable=False, default=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("started_at", sa.Float),
    sa.Column("finished_at", sa.Float),
    sa.Column("format", sa.String(16)),
    sa.Column("local_path", sa.String),
    sa.Column("preferred_quantized", sa.Boolean),
    sa.Column("bytes_done", sa.BigInteger, nullable=False, default=0),
    sa.Column("bytes_total", sa.BigInteger),
    sa.Column("current_file", sa.String),
    sa.Column("error", sa.Text),
    sa.Column("error_code", sa.String(32)),
    # Several fronts on one database: the front running (or holding queued) this job, and when
    # it last said so (front/ops/fronts.py renews it); a stale claim is a dead front's.
    sa.Column("claimed_by", sa.String(64)),
    sa.Column("claimed_at", sa.Float),
)

# Models that are on disk because a pull or an import put them there (the catalog's `manual`).
models = sa.Table(
    "models",
    metadata,
    sa.Column("id", sa.String, primary_key=True),
    sa.Column("source", sa.String(16), nullable=False),  # pulled | imported
    sa.Column("ref", sa.String),
    sa.Column("format", sa.String(16), nullable=False),  # gguf | safetensors
    sa.Column("path", sa.String, nullable=False),
    sa.Column("mmproj", sa.String),
    sa.Column("files", sa.JSON, nullable=False, default=list),
    sa.Column("revision", sa.String),
    sa.Column("quantize", sa.String(8)),
    sa.Column("added_at", sa.Float, nullable=False),
)

aliases = sa.Table(
    "aliases",
    metadata,
    sa.Column("name", sa.String, primary_key=True),
    sa.Column("model", sa.String, nullable=False),
)

# Presets made by Ollama's /api/create (a Modelfile): `spec` is a config Preset as JSON, plus
# the TEMPLATE it was given (shown by /api/show; llama-server renders the model's own).
presets = sa.Table(
    "presets",
    metadata,
    sa.Column("id", sa.String, primary_key=True),
    sa.Column("spec", sa.JSON, nullable=False),
    sa.Column("template", sa.String),
    sa.Column("created_at", sa.Float, nullable=False),
)


users = sa.Table(
    "users",
    metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("password_hash", sa.String, nullable=False),  # argon2id
    sa.Column("is_admin", sa.Boolean, nullable=False, default=False),
    sa.Column("must_change_password", sa.Boolean, nullable=False, default=False),
    sa.Column("archive_retention", sa.String(8)),  # the user's default; None = server default
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("group_name", sa.String(64)),  # teams: limits and fair-share weights by group
)

# A web login session: the signed cookie carries only the id; logout or a password change deletes
# it. The Python name says "login" (chat sessions are another thing, below); the table keeps its
# name "sessions" so existing databases need no migration.
login_sessions = sa.Table(
    "sessions",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("user", sa.String(64), nullable=False, index=True),
    sa.Column("csrf", sa.String(64), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
)

# API bearer tokens: shown once, stored as a SHA-256 of the token (they are 256-bit random, so a
# slow hash adds nothing but latency on every request).
tokens = sa.Table(
    "tokens",
    metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("name", sa.String(64), nullable=False),
    sa.Column("owner", sa.String(64), nullable=False, index=True),
    sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
    sa.Column("prefix", sa.String(16), nullable=False),  # to recognise it in lists
    sa.Column("scopes", sa.JSON, nullable=False),  # ["inference"] or ["inference", "admin"]
    sa.Column("archive_retention", sa.String(8)),  # default retention of what it archives
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float),
    sa.Column("last_used_at", sa.Float),
    # The token it was minted with (POST /tokens with a token): revoking that one revokes this.
    sa.Column("parent_id", sa.String(32), index=True),
)

# Generated files and transcripts; the bytes live under $MODELYARD_HOME/archive/<id>.
archive = sa.Table(
    "archive",
    metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("owner", sa.String(64), index=True),  # None: anonymous (loopback, auth auto)
    sa.Column("kind", sa.String(16), nullable=False),  # chat | image | speech | transcription
    sa.Column("model", sa.String),
    sa.Column("filename", sa.String, nullable=False),  # the download name, never a path
    sa.Column("media_type", sa.String, nullable=False),
    sa.Column("size_bytes", sa.BigInteger, nullable=False),
    sa.Column("retention", sa.String(8), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, index=True),  # None: kept forever
    sa.Column("meta", sa.JSON, nullable=False, default=dict),
)

# Server-side chat sessions (front/chat/sessions/store.py), kept only with `chat_session_persist`;
# not the login sessions above.
chat_sessions = sa.Table(
    "chat_sessions",
    metadata,
    sa.Column("owner", sa.String(64), primary_key=True),  # "": anonymous callers
    sa.Column("id", sa.String(128), primary_key=True),
    sa.Column("model", sa.String, nullable=False),
    sa.Column("messages", sa.JSON, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("last_used_at", sa.Float, nullable=False, index=True),
    sa.Column("turns", sa.Integer, nullable=False),
    sa.Column("stats", sa.JSON, nullable=False, default=dict),
)


# ---- quotas and rate limits (front/identity/limits.py) ---------------------------------------
# One row per limited subject: `token:<id>`, `user:<name>`, `group:<name>` or `default`; a
# NULL field is no limit.
limits = sa.Table(
    "limits",
    metadata,
    sa.Column("subject", sa.String(100), primary_key=True),
    sa.Column("requests_per_minute", sa.Integer),
    sa.Column("tokens_per_day", sa.BigInteger),
    sa.Column("max_concurrent", sa.Integer),
    # The largest Ollama `num_ctx` a request may ask beyond its model's served context (a larger
    # context starts a server of its own: front/chat/context.py); not a counter.
    sa.Column("max_num_ctx", sa.Integer),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("updated_by", sa.String(64)),
)

# Counters every front shares: requests in a minute, tokens in a UTC day (`kind` minute | day,
# `window_start` its start in epoch seconds); the row (`slots`, 0) of a subject is the lock
# its concurrency slots are taken under. Old windows are pruned.
rate_counters = sa.Table(
    "rate_counters",
    metadata,
    sa.Column("subject", sa.String(100), primary_key=True),
    sa.Column("kind", sa.String(8), primary_key=True),
    sa.Column("window_start", sa.BigInteger, primary_key=True),
    sa.Column("count", sa.BigInteger, nullable=False),
)

# Requests running now of a subject with `max_concurrent`: a row each, owned by a front that
# keeps pushing `expires_at` forward; a front that died leaves rows that expire.
concurrency_slots = sa.Table(
    "concurrency_slots",
    metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("subject", sa.String(100), nullable=False, index=True),
    sa.Column("front_id", sa.String(32), nullable=False, index=True),
    sa.Column("expires_at", sa.Float, nullable=False),
)

# ---- usage accounting (front/ops/usage.py) ------------------------------------------------------
# Inference requests summed per hour (UTC, `hour` = the hour's start in unix seconds) and per
# owner ("" anonymous), API token ("" none), model ("" never routed) and API. Every front adds to
# the same rows (an upsert that increments), so the sums hold across several fronts.
usage_hourly = sa.Table(
    "usage_hourly",
    metadata,
    sa.Column("hour", sa.BigInteger, primary_key=True),
    sa.Column("owner", sa.String(64), primary_key=True),
    sa.Column("token_id", sa.String(32), primary_key=True),
    sa.Column("model", sa.String(255), primary_key=True),
    sa.Column("api", sa.String(16), primary_key=True),
    sa.Column("requests", sa.BigInteger, nullable=False, default=0),
    sa.Column("errors", sa.BigInteger, nullable=False, default=0),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=False, default=0),  # cached included
    sa.Column("cached_tokens", sa.BigInteger, nullable=False, default=0),
    sa.Column("completion_tokens", sa.BigInteger, nullable=False, default=0),
    sa.Column("ttft_sum_s", sa.Float, nullable=False, default=0.0),
    sa.Column("ttft_count", sa.BigInteger, nullable=False, default=0),  # records with a TTFT
    sa.Column("duration_sum_s", sa.Float, nullable=False, default=0.0),
    sa.Column("queue_wait_sum_s", sa.Float, nullable=False, default=0.0),
    sa.Column("swaps", sa.BigInteger, nullable=False, default=0),
)

# ---- Batch API (/v1/files, /v1/batches: front/batches/) ------------------------------------
# Uploaded and generated files; the bytes live under $MODELYARD_HOME/files/<id> (0600).
files = sa.Table(
    "files",
    metadata,
    sa.Column("id", sa.String(40), primary_key=True),
    sa.Column("owner", sa.String(64), nullable=False, index=True),  # "": anonymous
    sa.Column("purpose", sa.String(16), nullable=False),  # batch | batch_output
    sa.Column("filename", sa.String, nullable=False),  # the name it was uploaded as
    sa.Column("size_bytes", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)

# One row per batch. Progress per line is the output and error files themselves (a finished
# line is appended to one of them as it ends; a resumed batch skips the custom_ids they hold);
# the counters here are what GET shows. `claimed_by`/`lease_until`: the front running it.
batches = sa.Table(
    "batches",
    metadata,
    sa.Column("id", sa.String(40), primary_key=True),
    sa.Column("owner", sa.String(64), nullable=False, index=True),
    sa.Column("owner_group", sa.String(64)),
    sa.Column("token_id", sa.String(32)),
    sa.Column("endpoint", sa.String(64), nullable=False),
    sa.Column("input_file_id", sa.String(40), nullable=False),
    sa.Column("completion_window", sa.String(8), nullable=False),
    sa.Column("status", sa.String(16), nullable=False, index=True),
    sa.Column("meta", sa.JSON),
    sa.Column("errors", sa.JSON),
    sa.Column("output_file_id", sa.String(40)),
    sa.Column("error_file_id", sa.String(40)),
    sa.Column("total", sa.Integer, nullable=False, default=0),
    sa.Column("completed", sa.Integer, nullable=False, default=0),
    sa.Column("failed", sa.Integer, nullable=False, default=0),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
    sa.Column("in_progress_at", sa.Float),
    sa.Column("finalizing_at", sa.Float),
    sa.Column("completed_at", sa.Float),
    sa.Column("failed_at", sa.Float),
    sa.Column("expired_at", sa.Float),
    sa.Column("cancelling_at", sa.Float),
    sa.Column("cancelled_at", sa.Float),
    sa.Column("claimed_by", sa.String(40)),
    sa.Column("lease_until", sa.Float),
)

# ---- several fronts on one database (front/ops/fronts.py) --------------------------------------
# Failed logins every front process counts together (front/identity/login_throttle_db.py): one
# row per key (`user:<name>`, `address:<ip>`), its streak as login_throttle.py keeps it.
login_failures = sa.Table(
    "login_failures",
    metadata,
    sa.Column("key", sa.String(300), primary_key=True),
    sa.Column("failures", sa.Integer, nullable=False),
    sa.Column("last_at", sa.Float, nullable=False),
    sa.Column("blocked_until", sa.Float, nullable=False),
    sa.Column("by_user", sa.JSON, nullable=False),
)

# A counter per shared event: `config` is bumped by a front that reloaded its config; the others
# see it move and reload too.
front_epochs = sa.Table(
    "front_epochs",
    metadata,
    sa.Column("name", sa.String(32), primary_key=True),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("updated_by", sa.String(64)),
    sa.Column("updated_at", sa.Float),
)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers (engines) never block the writer
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def _add_new_columns(engine: Engine) -> None:
    """Columns added to an existing table since a database was made (create_all makes only
    missing tables): each is nullable, so an ALTER TABLE ADD COLUMN brings the table up to date."""
    inspector = sa.inspect(engine)
    existing = set(inspector.get_table_names())
    for table in metadata.sorted_tables:
        if table.name not in existing:
            continue
        have = {c["name"] for c in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name in have:
                continue
            kind = column.type.compile(dialect=engine.dialect)
            try:
                with engine.begin() as conn:
                    conn.execute(sa.text(
                        f'ALTER TABLE "{table.name}" ADD COLUMN "{column.name}" {kind}'))
            except sa.exc.DBAPIError:
                # Another process (an engine starting beside the front) added it first.
                fresh = {c["name"] for c in sa.inspect(engine).get_columns(table.name)}
                if column.name not in fresh:
                    raise


class DatabaseDamaged(Exception):
    """The database file cannot be used as it is; the message says what and how to fix it."""


_SQLITE_MAGIC = b"SQLite format 3\x00"
_SQLITE_FULL = 13
_PG_DISK_FULL = "53100"


def sqlite_file(url: str) -> Path | None:
    """The database file of a SQLite URL; None for other databases and in-memory ones."""
    if not url.startswith("sqlite:///"):
        return None
    name = url.removeprefix("sqlite:///")
    return Path(name) if name and name != ":memory:" else None


def check(url: str) -> None:
    """Raise DatabaseDamaged when the SQLite file is there but unusable. SQLite takes a 0-byte
    file for a new database and create_all would then make a fresh first boot (users, tokens and
    jobs silently gone); a truncated one fails deep in a query. No file: a first boot. Call it
    before this process opens the database (see `connect`)."""
    path = sqlite_file(url)
    if path is None or not path.exists():
        return
    problem = _problem(path)
    if problem is not None:
        raise DatabaseDamaged(
            f"the database {path} {problem}: restore it from a backup, or run "
            "`modelyard db reset` to move it aside and start with an empty one"
        )


def _problem(path: Path) -> str | None:
    size = path.stat().st_size
    if size == 0:
        return "is empty (0 bytes)"
    with path.open("rb") as f:
        header = f.read(100)
    if not header.startswith(_SQLITE_MAGIC):
        return "is not a SQLite database"
    if len(header) < 100:
        return f"is truncated ({size} bytes)"
    page_size = int.from_bytes(header[16:18], "big") or 1
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    # The page count is valid when its "valid-for" counter matches the change counter.
    if header[92:96] == header[24:28] and pages * page_size > size:
        return f"is truncated ({size} of {pages * page_size} bytes)"
    try:
        conn = sqlite3.connect(path)
        try:
            result = conn.execute("PRAGMA quick_check").fetchall()
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        return f"is damaged ({exc})"
    if result != [("ok",)]:
        return f"is damaged ({result[0][0]})"
    return None


def _stamped(path: Path, label: str) -> Path:
    """`<name>.<label>-<UTC time>` beside `path`, with a counter if that is taken."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    candidate = path.with_name(f"{path.name}.{label}-{stamp}")
    n = 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{label}-{stamp}-{n}")
    return candidate


def backup(path: Path) -> Path:
    """A consistent copy of the database (SQLite's online backup, WAL included), owner-only."""
    dest = _stamped(path, "backup")
    os.close(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    source, target = sqlite3.connect(path), sqlite3.connect(dest)
    try:
        source.backup(target)
    finally:
        target.close()
        source.close()
    return dest


def move_aside(url: str) -> Path | None:
    """`modelyard db reset`: rename the database (and its -wal/-shm) to `<name>.reset-<time>`,
    so the next start is a first boot and nothing is lost. None when there is no file."""
    path = sqlite_file(url)
    if path is None:
        raise ValueError("`db reset` works on a SQLite database; drop a PostgreSQL one yourself")
    if not path.exists():
        return None
    dest = _stamped(path, "reset")
    for suffix in ("-wal", "-shm", ""):  # the main file last: sqlite finds the others by it
        part = path.with_name(path.name + suffix)
        if part.exists():
            part.rename(dest.with_name(dest.name + suffix))
    return dest


def schema_changes(engine: Engine) -> list[str]:
    """Tables and columns the code has that an existing database lacks (empty: none, or a new
    database with nothing to keep)."""
    inspector = sa.inspect(engine)
    existing = set(inspector.get_table_names())
    if not existing:
        return []
    changes: list[str] = []
    for table in metadata.sorted_tables:
        if table.name not in existing:
            changes.append(table.name)
            continue
        columns = {c["name"] for c in inspector.get_columns(table.name)}
        changes += [f"{table.name}.{c.name}" for c in table.columns if c.name not in columns]
    return changes


def _storage_full(context: sa.engine.ExceptionContext) -> None:
    """A full disk is the operator's to fix, not a server bug: 507 with what to do, instead of a
    500 carrying the driver's text."""
    orig = context.original_exception
    if (getattr(orig, "sqlite_errorcode", None) == _SQLITE_FULL
            or getattr(orig, "sqlstate", None) == _PG_DISK_FULL
            or getattr(orig, "pgcode", None) == _PG_DISK_FULL):
        raise InsufficientStorage(
            "the disk holding the database is full; nothing was written (free some space)"
        ) from orig


def connect(url: str) -> Engine:
    """An engine with the schema created (idempotent); before the schema changes, the database
    is backed up beside itself. `check` is for a process's start, not here: it reads the file's
    header with a plain open/close, and closing any descriptor of a file drops every POSIX lock
    the process holds on it, SQLite's included (a pull's rescan then failed with I/O errors)."""
    path = sqlite_file(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    sqlite = url.startswith("sqlite")
    # A database server (several fronts) may restart or drop idle connections: each checkout
    # is pinged first, so a front recovers instead of failing its next request.
    engine = sa.create_engine(url, connect_args={"check_same_thread": False} if sqlite else {},
                              pool_pre_ping=not sqlite)
    if url.startswith("sqlite"):
        sa.event.listen(engine, "connect", _sqlite_pragmas)
    sa.event.listen(engine, "handle_error", _storage_full)
    changes = schema_changes(engine)
    if changes and path is not None:
        saved = backup(path)
        log.info("database schema changes (%s): backed up to %s", ", ".join(changes), saved)
    for attempt in range(5):
        try:
            metadata.create_all(engine)
            break
        except sa.exc.DBAPIError:
            # Several fronts starting at once on an empty PostgreSQL database: another one
            # created a table between our check and our CREATE; the next pass skips it.
            if attempt == 4:
                raise
    _add_new_columns(engine)
    if path is not None and path.is_file():
        # Password and token hashes live here: the owner only (new -wal/-shm follow the umask
        # `serve` sets; files older versions left are tightened by home.secure).
        path.chmod(0o600)
    return engine


def rows(result: sa.CursorResult[Any]) -> list[dict[str, Any]]:
    return [dict(r._mapping) for r in result]
