"""`modelyard users …` and `modelyard tokens …`: accounts, straight in the database.

They work with the server up or down (whoever can write $MODELYARD_HOME owns the server anyway);
a token revoked here stops working on a running server within two seconds.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
from pathlib import Path
from typing import Annotated

import sqlalchemy as sa
import typer
from rich.console import Console
from rich.table import Table

from modelyard import db
from modelyard.config import load_settings
from modelyard.errors import ModelyardError
from modelyard.front.identity import accounts, tokens

console = Console()
err_console = Console(stderr=True)
users_app = typer.Typer(help="Users of the Web Studio and the API.", no_args_is_help=True)
tokens_app = typer.Typer(help="API bearer tokens (shown once, stored hashed).",
                         no_args_is_help=True)
ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="YAML config file (default: $MODELYARD_HOME/config.yaml)."),
]
_DURATION = re.compile(r"^(\d+)([smhdwy])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, "y": 365 * 86400}


def _database(config: Path | None) -> sa.Engine:
    return db.connect(load_settings(config).db_url)


def _fail(exc: ModelyardError) -> typer.Exit:
    err_console.print(f"[red]error:[/red] {exc.message}")
    return typer.Exit(1)


def _password(prompt: str, from_stdin: bool) -> str:
    if from_stdin:
        return sys.stdin.readline().rstrip("\n")
    value: str = typer.prompt(prompt, hide_input=True, confirmation_prompt=True)
    return value


def _when(ts: float | None) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else "-"


@users_app.command("ls")
def users_ls(config: ConfigOption = None) -> None:
    """List users."""
    table = Table("NAME", "ADMIN", "GROUP", "MUST CHANGE PASSWORD", "CREATED")
    for user in accounts.list_users(_database(config)):
        table.add_row(user.name, "yes" if user.is_admin else "no", user.group or "-",
                      "yes" if user.must_change_password else "no", _when(user.created_at))
    console.print(table)


@users_app.command("add")
def users_add(
    name: str,
    admin: Annotated[bool, typer.Option("--admin", help="May manage models and users.")] = False,
    password_stdin: Annotated[bool, typer.Option(help="Read the password from stdin.")] = False,
    config: ConfigOption = None,
) -> None:
    """Add a user (they choose their own password at first login)."""
    try:
        accounts.add_user(_database(config), name, _password("Password", password_stdin),
                          is_admin=admin, must_change_password=True)
    except ModelyardError as exc:
        raise _fail(exc) from exc
    console.print(f"user {name} added; they will choose a new password at first login")


@users_app.command("passwd")
def users_passwd(
    name: str,
    password_stdin: Annotated[bool, typer.Option(help="Read the password from stdin.")] = False,
    keep: Annotated[bool, typer.Option("--keep", help="Do not ask for a change at next "
                                                      "login.")] = False,
    config: ConfigOption = None,
) -> None:
    """Set a user's password (their sessions end, their tokens are revoked; the CLI's own
    token is replaced by a new one when it was theirs)."""
    try:
        settings = load_settings(config)
        accounts.set_password(db.connect(settings.db_url), name,
                              _password("New password", password_stdin),
                              must_change_password=not keep, home=settings.home)
    except ModelyardError as exc:
        raise _fail(exc) from exc
    console.print(f"password of {name} set")


@users_app.command("set-group")
def users_set_group(
    name: str,
    group: Annotated[str | None, typer.Argument(help="The group; omitted: none.")] = None,
    config: ConfigOption = None,
) -> None:
    """Put a user in a group (limits and fair-share weights may be set per group)."""
    try:
        accounts.set_group(_database(config), name, group)
    except ModelyardError as exc:
        raise _fail(exc) from exc
    console.print(f"user {name} is in group {group}" if group else f"user {name} has no group")


@users_app.command("rm")
def users_rm(name: str, config: ConfigOption = None) -> None:
    """Remove a user with their sessions and tokens (their archive stays, for admins)."""
    database = _database(config)
    admins = [u.name for u in accounts.list_users(database) if u.is_admin]
    if admins == [name]:
        err_console.print("[red]error:[/red] this is the last admin; add another admin first")
        raise typer.Exit(1)
    try:
        accounts.remove_user(database, name)
    except ModelyardError as exc:
        raise _fail(exc) from exc
    console.print(f"user {name} removed")


def parse_duration(text: str) -> float:
    """`90s`, `30m`, `12h`, `30d`, `2w`, `1y` → seconds."""
    match = _DURATION.match(text.strip())
    if not match:
        raise typer.BadParameter("a duration like 30m, 12h, 30d, 2w or 1y")
    return int(match.group(1)) * _SECONDS[match.group(2)]


@tokens_app.command("create")
def tokens_create(
    name: str,
    owner: Annotated[str, typer.Option(help="The user the token acts as.")] = accounts.ADMIN,
    scope: Annotated[list[str] | None, typer.Option(
        help="inference and/or admin (repeatable; default inference).")] = None,
    expires: Annotated[str | None, typer.Option(help="Lifetime, e.g. 30d; default: none.")] = None,
    config: ConfigOption = None,
) -> None:
    """Create a token and print it once (save it now: only its hash is kept)."""
    try:
        token, secret = tokens.create_token(
            _database(config), owner, name, scope or ["inference"],
            expires_in_s=parse_duration(expires) if expires else None)
    except ModelyardError as exc:
        raise _fail(exc) from exc
    err_console.print(f"token {token.id} ({', '.join(token.scopes)}) for {owner}; it is shown "
                      "only now:")
    print(secret)


@tokens_app.command("ls")
def tokens_ls(
    owner: Annotated[str | None, typer.Option(help="Only this user's tokens.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines, for scripts.")] = False,
    config: ConfigOption = None,
) -> None:
    """List tokens (never their secrets)."""
    found = tokens.list_tokens(_database(config), owner)
    if as_json:
        for t in found:
            print(json.dumps(t.public()))
        return
    table = Table("ID", "NAME", "OWNER", "PREFIX", "SCOPES", "CREATED", "EXPIRES", "LAST USED")
    for t in found:
        table.add_row(t.id, t.name, t.owner, t.prefix + "…", ",".join(t.scopes),
                      _when(t.created_at), _when(t.expires_at), _when(t.last_used_at))
    console.print(table)


@tokens_app.command("revoke")
def tokens_revoke(token_id: str, config: ConfigOption = None) -> None:
    """Revoke a token by id."""
    try:
        tokens.revoke_token(_database(config), token_id)
    except ModelyardError as exc:
        raise _fail(exc) from exc
    console.print(f"token {token_id} revoked")
