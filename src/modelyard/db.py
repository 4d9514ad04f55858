"""modelyard's database: SQLite under MODELYARD_HOME by default, through SQLAlchemy Core.

What must survive a restart lives here: pull jobs, the models pulled and imported, aliases,
users, their sessions and API tokens, and the archive index.
SQLite runs in WAL mode so the front writes while engines read (they list pulled models).
Calls are blocking and short; async callers run them with `asyncio.to_thread`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

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


users = sa.Table(
    "users",
    metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("password_hash", sa.String, nullable=False),  # argon2id
    sa.Column("is_admin", sa.Boolean, nullable=False, default=False),
    sa.Column("must_change_password", sa.Boolean, nullable=False, default=False),
    sa.Column("archive_retention", sa.String(8)),  # the user's default; None = server default
    sa.Column("created_at", sa.Float, nullable=False),
)

# A web session: the signed cookie carries only the id; logout or a password change deletes it.
sessions = sa.Table(
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

# Server-side chat sessions (front/sessions.py), kept only with `chat_session_persist`; not the
# login sessions above.
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


def connect(url: str) -> Engine:
    """An engine with the schema created (idempotent)."""
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(url, connect_args={"check_same_thread": False}
                              if url.startswith("sqlite") else {})
    if url.startswith("sqlite"):
        sa.event.listen(engine, "connect", _sqlite_pragmas)
    metadata.create_all(engine)
    _add_new_columns(engine)
    database_file = Path(url.removeprefix("sqlite:///"))
    if url.startswith("sqlite:///") and database_file.is_file():
        # Password and token hashes live here: the owner only (WAL files inherit the mode).
        database_file.chmod(0o600)
    return engine


def rows(result: sa.CursorResult[Any]) -> list[dict[str, Any]]:
    return [dict(r._mapping) for r in result]
