"""Users, sessions and tokens in a real SQLite database (tmp dir)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import sqlalchemy as sa

from modelyard import db
from modelyard.errors import Conflict, Forbidden, InvalidRequest
from modelyard.front import accounts, tokens

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


@pytest.fixture
def database(tmp_path: Path) -> sa.Engine:
    return db.connect(f"sqlite:///{tmp_path / 'm.db'}")


def test_passwords_are_argon2id_hashes_and_verify(database: sa.Engine) -> None:
    accounts.add_user(database, "alice", "correct horse", is_admin=False)
    with database.connect() as conn:
        stored = conn.execute(sa.select(db.users.c.password_hash)).scalar()
    assert stored.startswith("$argon2id$") and "correct horse" not in stored
    assert accounts.verify_password(database, "alice", "correct horse") is not None
    assert accounts.verify_password(database, "alice", "wrong horse") is None
    assert accounts.verify_password(database, "nobody", "correct horse") is None


def test_names_and_passwords_are_validated(database: sa.Engine) -> None:
    with pytest.raises(InvalidRequest, match="at least 8"):
        accounts.add_user(database, "bob", "short")
    for bad in ("", "-x", "a b", "../etc", "x" * 65):
        with pytest.raises(InvalidRequest):
            accounts.add_user(database, bad, "long enough")
    accounts.add_user(database, "bob", "long enough")
    with pytest.raises(Conflict):
        accounts.add_user(database, "bob", "long enough")


def test_first_admin_is_made_once(database: sa.Engine) -> None:
    generated = accounts.ensure_first_admin(database, None)
    assert generated and len(generated) >= 12
    admin = accounts.verify_password(database, "admin", generated)
    assert admin is not None and admin.is_admin and admin.must_change_password
    assert accounts.ensure_first_admin(database, None) is None
    assert [u.name for u in accounts.list_users(database)] == ["admin"]


def test_a_given_first_password_is_not_returned(tmp_path: Path) -> None:
    database = db.connect(f"sqlite:///{tmp_path / 'g.db'}")
    assert accounts.ensure_first_admin(database, "from-the-env") is None
    assert accounts.verify_password(database, "admin", "from-the-env") is not None


def test_password_change_ends_every_session(database: sa.Engine) -> None:
    user = accounts.add_user(database, "carol", "first pass")
    one = accounts.open_session(database, user, 3600)
    two = accounts.open_session(database, user, 3600)
    found = accounts.find_session(database, one.id)
    assert found is not None and found.user.name == "carol" and found.csrf == one.csrf
    accounts.set_password(database, "carol", "second pass", must_change_password=False)
    assert accounts.find_session(database, one.id) is None
    assert accounts.find_session(database, two.id) is None


def test_expired_sessions_are_not_found(database: sa.Engine) -> None:
    user = accounts.add_user(database, "dan", "long enough")
    session = accounts.open_session(database, user, -1)
    assert accounts.find_session(database, session.id) is None


def test_tokens_are_hashed_scoped_and_expire(database: sa.Engine) -> None:
    accounts.add_user(database, "root", "long enough", is_admin=True)
    accounts.add_user(database, "eve", "long enough")
    token, secret = tokens.create_token(database, "root", "ci", ["admin", "inference"])
    assert token.scopes == ("inference", "admin") and secret.startswith("my-")
    with database.connect() as conn:
        assert secret not in str(conn.execute(sa.select(db.tokens)).all())
    found = tokens.find_token(database, secret)
    assert found is not None and found.last_used_at is not None
    assert tokens.find_token(database, secret + "x") is None
    assert tokens.find_token(database, "sk-not-ours") is None
    _, short = tokens.create_token(database, "root", "short", ["inference"], expires_in_s=-1)
    assert tokens.find_token(database, short) is None
    with pytest.raises(Forbidden):
        tokens.create_token(database, "eve", "x", ["admin"])
    with pytest.raises(InvalidRequest):
        tokens.create_token(database, "eve", "x", ["root"])
    with pytest.raises(InvalidRequest):
        tokens.create_token(database, "ghost", "x", ["inference"])


def test_revoking_respects_the_owner(database: sa.Engine) -> None:
    accounts.add_user(database, "root", "long enough", is_admin=True)
    accounts.add_user(database, "eve", "long enough")
    theirs, _ = tokens.create_token(database, "root", "a", ["inference"])
    with pytest.raises(tokens.TokenNotFound):
        tokens.revoke_token(database, theirs.id, owner="eve")
    tokens.revoke_token(database, theirs.id)
    assert tokens.list_tokens(database) == []


def test_the_cli_token_file_is_0600_and_replaced_only_when_dead(
    database: sa.Engine, tmp_path: Path,
) -> None:
    accounts.add_user(database, "admin", "long enough", is_admin=True)
    path = tokens.ensure_cli_token(database, tmp_path, "admin")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = path.read_text()
    assert tokens.ensure_cli_token(database, tmp_path, "admin").read_text() == first
    (cli,) = tokens.list_tokens(database)
    tokens.revoke_token(database, cli.id)
    assert tokens.ensure_cli_token(database, tmp_path, "admin").read_text() != first
    assert len(tokens.list_tokens(database)) == 1


def test_removing_a_user_removes_sessions_and_tokens(database: sa.Engine) -> None:
    user = accounts.add_user(database, "frank", "long enough")
    session = accounts.open_session(database, user, 3600)
    _, secret = tokens.create_token(database, "frank", "t", ["inference"])
    accounts.remove_user(database, "frank")
    assert accounts.find_session(database, session.id) is None
    assert tokens.find_token(database, secret) is None
    with pytest.raises(accounts.UserNotFound):
        accounts.remove_user(database, "frank")
