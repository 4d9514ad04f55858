"""`modelyard db …`: the database itself (with the server stopped)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from modelyard import db, home
from modelyard.config import load_settings

console = Console()
err_console = Console(stderr=True)
db_app = typer.Typer(help="The database under MODELYARD_HOME.", no_args_is_help=True)


@db_app.command("reset")
def reset(
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c",
                     help="YAML config file (default: $MODELYARD_HOME/config.yaml)."),
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Start over with an empty database: users, tokens, jobs, chat sessions and the archive
    index are gone from the server's view. The old file is moved aside (renamed
    `modelyard.db.reset-<time>`), never deleted. Stop the server first."""
    home.private_umask()
    settings = load_settings(config)
    path = db.sqlite_file(settings.db_url)
    if path is None:
        err_console.print("[red]error:[/red] `db reset` works on the SQLite database; "
                          "drop or restore a PostgreSQL one with its own tools")
        raise typer.Exit(2)
    if not path.exists():
        console.print(f"no database at {path}: the next start is a first boot")
        return
    if not yes:
        typer.confirm(f"Move {path} aside and start over with an empty database?", abort=True)
    moved = db.move_aside(settings.db_url)
    console.print(f"moved the database to {moved}; the next start is a first boot")
