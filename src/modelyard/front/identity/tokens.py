"""API bearer tokens: created once and shown once, stored as a SHA-256 of the secret.

A token is `my-` + 43 url-safe characters (256 random bits), so a fast hash is as safe as a slow
one and keeps the lookup on every request cheap. Each token has an owner, scopes (`inference`,
`admin`), an optional expiry and a last-used time (written at most once a minute).

A token minted with another token (POST /tokens with an admin token) records it as its parent:
it can never hold a scope its parent lacks nor outlive it, and revoking a token revokes every
token minted from it. Changing a user's password revokes all of that user's tokens.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from modelyard import db
from modelyard.errors import Forbidden, InvalidRequest, ModelyardError

PREFIX = "my-"
SCOPES = ("inference", "admin")
CLI_TOKEN_FILE = "cli-token"
_LAST_USED_EVERY_S = 60.0


class TokenNotFound(ModelyardError):
    status = 404
    code = "token_not_found"

    def __init__(self, token_id: str) -> None:
        super().__init__(f"no token {token_id!r} (or it is not yours); GET /tokens lists yours")


@dataclass(frozen=True)
class Token:
    id: str
    name: str
    owner: str
    owner_is_admin: bool
    prefix: str
    scopes: tuple[str, ...]
    archive_retention: str | None
    created_at: float
    expires_at: float | None
    last_used_at: float | None
    owner_retention: str | None = None  # the owner's default, used when the token has none
    parent_id: str | None = None  # the token it was minted with; revoked with it
    owner_group: str | None = None  # the owner's group (teams: limits, fair share)

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id, "name": self.name, "owner": self.owner, "prefix": self.prefix,
            "scopes": list(self.scopes), "archive_retention": self.archive_retention,
            "created_at": self.created_at, "expires_at": self.expires_at,
            "last_used_at": self.last_used_at, "parent_id": self.parent_id,
        }


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def check_scopes(scopes: list[str], *, owner_is_admin: bool) -> tuple[str, ...]:
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown or not scopes:
        raise InvalidRequest(f"scopes are a non-empty list of {', '.join(SCOPES)}; got "
                             f"{unknown or scopes}", param="scopes")
    if "admin" in scopes and not owner_is_admin:
        raise Forbidden("only an admin's token may have the admin scope", param="scopes")
    return tuple(s for s in SCOPES if s in scopes)


def _query() -> sa.Select[Any]:
    return (sa.select(*db.tokens.c, db.users.c.is_admin,
                      db.users.c.archive_retention.label("owner_retention"),
                      db.users.c.group_name.label("owner_group"))
            .join(db.users, db.users.c.name == db.tokens.c.owner))


def _token(row: Any) -> Token:
    return Token(row.id, row.name, row.owner, row.is_admin, row.prefix, tuple(row.scopes),
                 row.archive_retention, row.created_at, row.expires_at, row.last_used_at,
                 row.owner_retention, row.parent_id, row.owner_group)


def create_token(engine: sa.Engine, owner: str, name: str, scopes: list[str], *,
                 expires_in_s: float | None = None, archive_retention: str | None = None,
                 parent: Token | None = None) -> tuple[Token, str]:
    """The new token and its secret (the only time the secret exists outside the client).

    With `parent` (the token the request came with), the new one gets no scope the parent lacks
    (403) and expires no later than the parent (a longer or missing lifetime is shortened)."""
    if not name or len(name) > 64:
        raise InvalidRequest("a token name is 1-64 characters", param="name")
    with engine.connect() as conn:
        is_admin = conn.execute(
            sa.select(db.users.c.is_admin).where(db.users.c.name == owner)).scalar()
    if is_admin is None:
        raise InvalidRequest(f"no user {owner!r} to own the token", param="owner")
    ordered = check_scopes(scopes, owner_is_admin=bool(is_admin))
    now = time.time()
    expires_at = now + expires_in_s if expires_in_s else None
    if parent is not None:
        beyond = sorted(set(ordered) - set(parent.scopes))
        if beyond:
            raise Forbidden(f"a token cannot grant scopes the token creating it lacks: "
                            f"{', '.join(beyond)}", param="scopes")
        if parent.expires_at is not None:
            expires_at = min(expires_at or parent.expires_at, parent.expires_at)
    secret = PREFIX + secrets.token_urlsafe(32)
    token = Token(secrets.token_hex(8), name, owner, bool(is_admin), secret[:10], ordered,
                  archive_retention, now, expires_at, None,
                  parent_id=parent.id if parent else None)
    with engine.begin() as conn:
        conn.execute(db.tokens.insert().values(
            id=token.id, name=name, owner=owner, token_hash=hash_secret(secret),
            prefix=token.prefix, scopes=list(ordered), archive_retention=archive_retention,
            created_at=now, expires_at=token.expires_at, last_used_at=None,
            parent_id=token.parent_id))
    return token, secret


def list_tokens(engine: sa.Engine, owner: str | None = None) -> list[Token]:
    """Tokens of `owner`, or every token when None."""
    query = _query().order_by(db.tokens.c.created_at)
    if owner is not None:
        query = query.where(db.tokens.c.owner == owner)
    with engine.connect() as conn:
        return [_token(r) for r in conn.execute(query)]


def delete_with_descendants(conn: sa.Connection, where: sa.ColumnElement[bool]) -> int:
    """Deletes the tokens matching `where` and every token minted from them, however deep;
    returns how many matched `where`."""
    ids = [r.id for r in conn.execute(sa.select(db.tokens.c.id).where(where))]
    matched, seen = len(ids), set(ids)
    while ids:
        conn.execute(db.tokens.delete().where(db.tokens.c.id.in_(ids)))
        ids = [r.id for r in conn.execute(
            sa.select(db.tokens.c.id).where(db.tokens.c.parent_id.in_(ids))) if r.id not in seen]
        seen.update(ids)
    return matched


def revoke_token(engine: sa.Engine, token_id: str, owner: str | None = None) -> None:
    """Deletes it and the tokens minted from it; with `owner`, only if it is theirs (else it
    does not exist for them)."""
    where = db.tokens.c.id == token_id
    if owner is not None:
        where = sa.and_(where, db.tokens.c.owner == owner)
    with engine.begin() as conn:
        if not delete_with_descendants(conn, where):
            raise TokenNotFound(token_id)


def get_token(engine: sa.Engine, token_id: str) -> Token | None:
    """The live token with this id (expired ones are not)."""
    with engine.connect() as conn:
        row = conn.execute(_query().where(db.tokens.c.id == token_id)).first()
    if row is None or (row.expires_at is not None and row.expires_at <= time.time()):
        return None
    return _token(row)


def find_token(engine: sa.Engine, secret: str) -> Token | None:
    """The live token whose secret this is (expired ones are not), noting its use."""
    if not secret.startswith(PREFIX):
        return None
    now = time.time()
    with engine.connect() as conn:
        row = conn.execute(_query().where(db.tokens.c.token_hash == hash_secret(secret))).first()
    if row is None or (row.expires_at is not None and row.expires_at <= now):
        return None
    token = _token(row)
    if row.last_used_at is None or now - row.last_used_at > _LAST_USED_EVERY_S:
        with engine.begin() as conn:
            conn.execute(db.tokens.update().where(db.tokens.c.id == row.id)
                         .values(last_used_at=now))
        token = replace(token, last_used_at=now)
    return token


def write_secret_file(path: Path, secret: str) -> None:
    """Created with mode 0600 from the start (never world-readable, even for an instant)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.replace(tmp, path)


def ensure_cli_token(engine: sa.Engine, home: Path, owner: str, name: str = "cli") -> Path:
    """The CLI's admin token in `$MODELYARD_HOME/cli-token` (0600): kept while it still works,
    replaced when it was revoked or the database is new. Replacing revokes the owner's older
    tokens of that `name`: several fronts on one database each name theirs apart
    (`cli-<front id>`), so one front starting does not revoke another's."""
    path = home / CLI_TOKEN_FILE
    if path.exists() and find_token(engine, path.read_text().strip()) is not None:
        return path
    for old in list_tokens(engine, owner):
        if old.name == name:
            revoke_token(engine, old.id)
    _, secret = create_token(engine, owner, name, list(SCOPES))
    write_secret_file(path, secret)
    return path


def cli_token_owner(engine: sa.Engine, home: Path) -> str | None:
    """Whose live token `$MODELYARD_HOME/cli-token` holds (None: no file, or a dead token)."""
    try:
        secret = (home / CLI_TOKEN_FILE).read_text().strip()
    except OSError:
        return None
    with engine.connect() as conn:
        owner = conn.execute(sa.select(db.tokens.c.owner)
                             .where(db.tokens.c.token_hash == hash_secret(secret))).scalar()
    return str(owner) if owner is not None else None


def read_cli_token(home: Path) -> str | None:
    """What the CLI sends: MODELYARD_TOKEN, else the file first boot wrote."""
    if token := os.environ.get("MODELYARD_TOKEN"):
        return token
    path = home / CLI_TOKEN_FILE
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
