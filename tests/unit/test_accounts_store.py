"""Users, sessions and tokens in a real database: SQLite (tmp dir) and PostgreSQL."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from modelyard import db
from modelyard.errors import Conflict, Forbidden, InvalidRequest
from modelyard.front.identity import accounts, tokens

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


@pytest.fixture
def database(database_url: str) -> Iterator[sa.Engine]:
    engine = db.connect(database_url)
    yield engine
    engine.dispose()


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


def test_a_given_first_password_is_not_returned(database: sa.Engine) -> None:
    assert accounts.ensure_first_admin(database, "from-the-env") is None
    assert accounts.verify_password(database, "admin", "from-the-env") is not None


def test_password_change_ends_every_session(database: sa.Engine) -> None:
    user = accounts.add_user(database, "carol", "first pass")
    one = accounts.open_login_session(database, user, 3600)
    two = accounts.open_login_session(database, user, 3600)
    found = accounts.find_login_session(database, one.id)
    assert found is not None and found.user.name == "carol" and found.csrf == one.csrf
    accounts.set_password(database, "carol", "second pass", must_change_password=False)
    assert accounts.find_login_session(database, one.id) is None
    assert accounts.find_login_session(database, two.id) is None


def test_expired_sessions_are_not_found(database: sa.Engine) -> None:
    user = accounts.add_user(database, "dan", "long enough")
    login = accounts.open_login_session(database, user, -1)
    assert accounts.find_login_session(database, login.id) is None


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
    login = accounts.open_login_session(database, user, 3600)
    _, secret = tokens.create_token(database, "frank", "t", ["inference"])
    accounts.remove_user(database, "frank")
    assert accounts.find_login_session(database, login.id) is None
    assert tokens.find_token(database, secret) is None
    with pytest.raises(accounts.UserNotFound):
        accounts.remove_user(database, "frank")


def test_a_blank_or_huge_password_is_refused(database: sa.Engine) -> None:
    """Issue 15 §11: eight spaces were a valid password."""
    accounts.add_user(database, "gina", "long enough")
    for bad in (" " * 8, " " * 20, "\t" * 9, " abc    ", "x" * 1025):
        with pytest.raises(InvalidRequest, match="at least 8"):
            accounts.set_password(database, "gina", bad, must_change_password=False)
        with pytest.raises(InvalidRequest):
            accounts.add_user(database, "hank", bad)
    accounts.set_password(database, "gina", " spaces inside ok ", must_change_password=False)


def test_a_token_minted_with_a_token_is_bounded_by_it(database: sa.Engine) -> None:
    """Issue 15 §2: a child never outlives nor out-scopes its parent, and dies with it."""
    accounts.add_user(database, "root", "long enough", is_admin=True)
    parent, _ = tokens.create_token(database, "root", "p", ["inference", "admin"],
                                    expires_in_s=60)
    assert parent.expires_at is not None
    child, child_secret = tokens.create_token(database, "root", "c", ["inference"],
                                              parent=parent)
    assert child.expires_at == parent.expires_at and child.parent_id == parent.id
    longer, _ = tokens.create_token(database, "root", "l", ["inference"], expires_in_s=3600,
                                    parent=parent)
    assert longer.expires_at == parent.expires_at
    shorter, _ = tokens.create_token(database, "root", "s", ["inference"], expires_in_s=5,
                                     parent=parent)
    assert shorter.expires_at is not None and shorter.expires_at < parent.expires_at
    grandchild, grand_secret = tokens.create_token(database, "root", "g", ["inference"],
                                                   parent=child)
    with pytest.raises(Forbidden, match="admin"):
        tokens.create_token(database, "root", "x", ["inference", "admin"], parent=child)
    tokens.revoke_token(database, parent.id)
    assert tokens.find_token(database, child_secret) is None
    assert tokens.find_token(database, grand_secret) is None
    assert tokens.list_tokens(database) == []
    assert grandchild.parent_id == child.id


def test_a_password_change_revokes_the_users_tokens(database: sa.Engine, tmp_path: Path) -> None:
    """Issue 15 §2: tokens survived a reset of their owner's password. The CLI's token is
    replaced (a fresh secret in the same 0600 file), not lost."""
    accounts.add_user(database, "admin", "long enough", is_admin=True)
    accounts.add_user(database, "ivy", "long enough")
    cli_file = tokens.ensure_cli_token(database, tmp_path, "admin")
    old_cli = cli_file.read_text().strip()
    _, ivy_secret = tokens.create_token(database, "ivy", "t", ["inference"])
    _, admin_secret = tokens.create_token(database, "admin", "t", ["inference"])
    accounts.set_password(database, "ivy", "another pass", must_change_password=True,
                          home=tmp_path)
    assert tokens.find_token(database, ivy_secret) is None
    assert tokens.find_token(database, admin_secret) is not None
    assert cli_file.read_text().strip() == old_cli  # not ivy's: untouched
    accounts.set_password(database, "admin", "another pass", must_change_password=False,
                          home=tmp_path)
    assert tokens.find_token(database, admin_secret) is None
    assert tokens.find_token(database, old_cli) is None
    new_cli = cli_file.read_text().strip()
    assert new_cli != old_cli and tokens.find_token(database, new_cli) is not None
    assert stat.S_IMODE(cli_file.stat().st_mode) == 0o600


def test_an_older_database_gets_the_new_token_column(database_url: str) -> None:
    """A tokens table made before `parent_id` existed is brought up to date on connect."""
    url = database_url
    old = sa.create_engine(url)
    with old.begin() as conn:
        conn.execute(sa.text(
            "CREATE TABLE tokens (id VARCHAR(32) PRIMARY KEY, name VARCHAR(64) NOT NULL, "
            "owner VARCHAR(64) NOT NULL, token_hash VARCHAR(64) NOT NULL UNIQUE, "
            "prefix VARCHAR(16) NOT NULL, scopes JSON NOT NULL, archive_retention VARCHAR(8), "
            "created_at FLOAT NOT NULL, expires_at FLOAT, last_used_at FLOAT)"))
    old.dispose()
    database = db.connect(url)
    assert "parent_id" in {c["name"] for c in sa.inspect(database).get_columns("tokens")}
    accounts.add_user(database, "root", "long enough", is_admin=True)
    parent, _ = tokens.create_token(database, "root", "p", ["inference", "admin"])
    child, _ = tokens.create_token(database, "root", "c", ["inference"], parent=parent)
    listed = {t.id: t for t in tokens.list_tokens(database)}
    assert listed[child.id].parent_id == parent.id
