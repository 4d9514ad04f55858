"""`modelyard limits …`: quotas and rate limits, straight in the database (docs/teams.md).

Like `modelyard users`, they work with the server up or down; a running front applies an edit
made here within `limits_refresh_s` (2 s by default).
"""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Table

from modelyard.cli.accounts import ConfigOption, _database, _fail, _when, console
from modelyard.errors import ModelyardError
from modelyard.front.identity import limits_store as store
from modelyard.front.identity.limits import ANONYMOUS

limits_app = typer.Typer(
    help="Quotas and rate limits per token, user or group (`default`: every user without "
         "their own).", no_args_is_help=True)


def _cell(value: int | None, used: int | None = None) -> str:
    if value is None:
        return "-"
    return str(value) if used is None else f"{used}/{value}"


@limits_app.command("ls")
def limits_ls(config: ConfigOption = None) -> None:
    """List the limits, with what each subject used (this minute, today, running now)."""
    database = _database(config)
    rows = store.list_limits(database)
    usage = store.usage(database, [r.subject for r in rows] + [ANONYMOUS], time.time())
    table = Table("SUBJECT", "REQUESTS/MIN", "TOKENS/DAY", "CONCURRENT", "MAX NUM_CTX",
                  "UPDATED")
    for row in rows:
        used = usage.get(row.subject, {})  # `default` is counted per user: no figures
        table.add_row(
            row.subject,
            _cell(row.requests_per_minute, used.get("requests_this_minute")),
            _cell(row.tokens_per_day, used.get("tokens_today")),
            _cell(row.max_concurrent, used.get("concurrent")),
            _cell(row.max_num_ctx),
            f"{_when(row.updated_at)} {row.updated_by or ''}".strip())
    console.print(table)


@limits_app.command("set")
def limits_set(
    subject: Annotated[str, typer.Argument(
        help="token:<id>, user:<name>, group:<name> or default")],
    rpm: Annotated[int | None, typer.Option("--rpm", help="Requests per minute.")] = None,
    tokens_per_day: Annotated[int | None, typer.Option(
        "--tokens-per-day", help="Prompt + completion tokens per UTC day.")] = None,
    concurrent: Annotated[int | None, typer.Option(
        "--concurrent", help="Requests running at once.")] = None,
    max_num_ctx: Annotated[int | None, typer.Option(
        "--max-num-ctx", help="The largest Ollama num_ctx beyond a model's served context (a "
        "server of its own); 0: never beyond.")] = None,
    config: ConfigOption = None,
) -> None:
    """Set a subject's limits (replacing all of them: a limit not given is no limit)."""
    try:
        store.set_limit(_database(config), subject, requests_per_minute=rpm,
                        tokens_per_day=tokens_per_day, max_concurrent=concurrent, by=None,
                        max_num_ctx=max_num_ctx)
    except ModelyardError as exc:
        raise _fail(exc) from exc
    console.print(f"limits of {subject} set")


@limits_app.command("rm")
def limits_rm(subject: str, config: ConfigOption = None) -> None:
    """Remove a subject's limits."""
    try:
        store.remove_limit(_database(config), subject)
    except ModelyardError as exc:
        raise _fail(exc) from exc
    console.print(f"limits of {subject} removed")

