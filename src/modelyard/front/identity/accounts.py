"""Users and their web sessions, in the database.

Passwords are hashed with argon2id (argon2-cffi's defaults). A session row is what a signed
cookie points to, so logging out or changing a password ends it on the server, not only in the
browser. Calls are blocking; the front runs them with `asyncio.to_thread`, the CLI directly.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

from modelyard import db
from modelyard.errors import Conflict, InvalidRequest, ModelyardError
from modelyard.front.identity import tokens

ADMIN = "admin"
MIN_PASSWORD_LENGTH = 8
MAX_PASSWORD_LENGTH = 1024  # argon2 hashes any length; this bounds the work a request asks for
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_hasher = PasswordHasher()
# Verified against when the user does not exist, so a wrong name costs what a wrong password does.
_DUMMY_HASH = _hasher.hash(secrets.token_urlsafe(16))


class UserNotFound(ModelyardError):
    status = 404
    code = "user_not_found"

    def __init__(self, name: str) -> None:
        super().__init__(f"no user {name!r}; `modelyard users ls` lists them", param="name")


@dataclass(frozen=True)
class User:
    name: str
    is_admin: bool
    must_change_password: bool
    archive_retention: str | None
    created_at: float
    group: str | None = None  # teams: limits and fair-share weights may be set per group

    def public(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "is_admin": self.is_admin,
            "must_change_password": self.must_change_password,
            "archive_retention": self.archive_retention,
            "created_at": self.created_at,
            "group": self.group,
        }


@dataclass(frozen=True)
class LoginSession:
    id: str
    user: User
    csrf: str
    expires_at: float


def _user(row: Any) -> User:
    return User(row.name, row.is_admin, row.must_change_password, row.archive_retention,
                row.created_at, row.group_name)


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise InvalidRequest(
            "a user name is 1-64 letters, digits, '_', '.' or '-', starting with a letter or "
            "digit", param="name")
    return name


def check_password(password: str) -> str:
    """A new password: 8-1024 characters not counting spaces around it (eight spaces is no
    password)."""
    if len(password.strip()) < MIN_PASSWORD_LENGTH or len(password) > MAX_PASSWORD_LENGTH:
        raise InvalidRequest(
            f"a password needs at least {MIN_PASSWORD_LENGTH} characters, not counting spaces "
            f"at either end, and at most {MAX_PASSWORD_LENGTH}", param="password")
    return password


def list_users(engine: sa.Engine) -> list[User]:
    with engine.connect() as conn:
        return [_user(r) for r in conn.execute(sa.select(db.users).order_by(db.users.c.name))]


def get_user(engine: sa.Engine, name: str) -> User | None:
    with engine.connect() as conn:
        row = conn.execute(sa.select(db.users).where(db.users.c.name == name)).first()
    return _user(row) if row else None


def add_user(engine: sa.Engine, name: str, password: str, *, is_admin: bool = False,
             must_change_password: bool = False) -> User:
    check_name(name)
    check_password(password)
    row = {"name": name, "password_hash": _hasher.hash(password), "is_admin": is_admin,
           "must_change_password": must_change_password, "created_at": time.time()}
    try:
        with engine.begin() as conn:
            conn.execute(db.users.insert().values(**row))
    except sa.exc.IntegrityError as exc:
        raise Conflict(f"user {name!r} exists already", param="name") from exc
    user = get_user(engine, name)
    assert user is not None
    return user


def remove_user(engine: sa.Engine, name: str) -> None:
    """The user, their sessions and their tokens go; their archive items stay for admins."""
    with engine.begin() as conn:
        gone = conn.execute(db.users.delete().where(db.users.c.name == name)).rowcount
        if not gone:
            raise UserNotFound(name)
        conn.execute(db.login_sessions.delete().where(db.login_sessions.c.user == name))
        tokens.delete_with_descendants(conn, db.tokens.c.owner == name)


def set_password(engine: sa.Engine, name: str, password: str, *,
                 must_change_password: bool, home: Path | None = None) -> None:
    """Sets the password and ends every session and revokes every token of the user (with the
    tokens minted from them): whatever was done with a stolen password or cookie dies with it.

    The CLI's token (`$MODELYARD_HOME/cli-token`, given as `home`) is revoked too when it is the
    user's, and a fresh one is written in its place: `modelyard` commands keep working for
    whoever can read that file, while a copy taken earlier stops working."""
    check_password(password)
    cli_owner = tokens.cli_token_owner(engine, home) if home is not None else None
    with engine.begin() as conn:
        updated = conn.execute(
            db.users.update().where(db.users.c.name == name).values(
                password_hash=_hasher.hash(password), must_change_password=must_change_password)
        ).rowcount
        if not updated:
            raise UserNotFound(name)
        conn.execute(db.login_sessions.delete().where(db.login_sessions.c.user == name))
        tokens.delete_with_descendants(conn, db.tokens.c.owner == name)
    if home is not None and cli_owner == name:
        tokens.ensure_cli_token(engine, home, name)


def set_archive_retention(engine: sa.Engine, name: str, retention: str | None) -> None:
    """The user's default retention for what they archive (None: the server's default)."""
    with engine.begin() as conn:
        updated = conn.execute(db.users.update().where(db.users.c.name == name)
                               .values(archive_retention=retention)).rowcount
    if not updated:
        raise UserNotFound(name)


def check_group(group: str) -> str:
    """A group name follows the rule of user names (it appears in limit subjects)."""
    if not _NAME.match(group):
        raise InvalidRequest(
            "a group name is 1-64 letters, digits, '_', '.' or '-', starting with a letter or "
            "digit", param="group")
    return group


def set_group(engine: sa.Engine, name: str, group: str | None) -> None:
    """The user's group (None: none); a token's principal picks it up on its next lookup."""
    if group is not None:
        check_group(group)
    with engine.begin() as conn:
        updated = conn.execute(db.users.update().where(db.users.c.name == name)
                               .values(group_name=group)).rowcount
    if not updated:
        raise UserNotFound(name)


def verify_password(engine: sa.Engine, name: str, password: str) -> User | None:
    """The user when the password is theirs, else None (the same cost either way)."""
    with engine.connect() as conn:
        row = conn.execute(sa.select(db.users).where(db.users.c.name == name)).first()
    try:
        _hasher.verify(row.password_hash if row else _DUMMY_HASH, password)
    except (VerificationError, InvalidHashError):
        return None
    return _user(row) if row else None


def ensure_first_admin(engine: sa.Engine, password: str | None) -> str | None:
    """On first boot (no user at all) creates `admin`, who must change the password at first
    login. Returns the one-time password when it was generated here (to print once), else None."""
    if list_users(engine):
        return None
    generated = None if password else secrets.token_urlsafe(12)
    try:
        add_user(engine, ADMIN, password or generated or "", is_admin=True,
                 must_change_password=True)
    except Conflict:  # another process won the race
        return None
    return generated


# ---- login sessions ------------------------------------------------------------------------------


def open_login_session(engine: sa.Engine, user: User, ttl_s: float) -> LoginSession:
    now = time.time()
    login = LoginSession(secrets.token_urlsafe(32), user, secrets.token_urlsafe(32), now + ttl_s)
    with engine.begin() as conn:
        conn.execute(db.login_sessions.delete().where(db.login_sessions.c.expires_at < now))
        conn.execute(db.login_sessions.insert().values(
            id=login.id, user=user.name, csrf=login.csrf, created_at=now,
            expires_at=login.expires_at))
    return login


def find_login_session(engine: sa.Engine, login_id: str) -> LoginSession | None:
    login = db.login_sessions.c
    query = (sa.select(login.id.label("login_id"), login.csrf, login.expires_at,
                       *db.users.c)
             .join(db.users, db.users.c.name == db.login_sessions.c.user)
             .where(db.login_sessions.c.id == login_id,
                    db.login_sessions.c.expires_at > time.time()))
    with engine.connect() as conn:
        row = conn.execute(query).first()
    if row is None:
        return None
    return LoginSession(row.login_id, _user(row), row.csrf, row.expires_at)


def close_login_session(engine: sa.Engine, login_id: str) -> None:
    with engine.begin() as conn:
        conn.execute(db.login_sessions.delete().where(db.login_sessions.c.id == login_id))
