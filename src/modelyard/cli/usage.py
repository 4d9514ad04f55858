"""`modelyard usage`: GET /v1/usage as a table (or its CSV), with the CLI's token.

    modelyard usage [--owner NAME] [--model ID] [--since 24h|7d|ISO] [--group-by user,model] [--csv]
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from modelyard.cli.server_url import auth_headers, default_url

console = Console()
err_console = Console(stderr=True)

_SINCE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
COLUMNS = ("requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens",
           "total_tokens", "avg_ttft_s", "avg_duration_s")


def since_start(since: str, now: float) -> str:
    """`--since`: a duration back from now (30m, 24h, 7d, 2w) as unix seconds, or a time the
    server parses itself (ISO 8601, unix seconds)."""
    match = _SINCE.match(since.strip())
    if match is None:
        return since
    return str(int(now - float(match.group(1)) * _UNIT_S[match.group(2)]))


def render(body: dict[str, Any]) -> Table:
    keys = [k for k in ("period", "owner", "token_id", "model", "api")
            if any(k in row for row in body["data"])]
    table = Table(*[k.upper() for k in keys], *[c.upper() for c in COLUMNS],
                  title=f"usage {body['start']} → {body['end']}")
    for row in body["data"]:
        cells = [str(row.get(k)) if row.get(k) != "" else "(anonymous)" if k == "owner" else "-"
                 for k in keys]
        for c in COLUMNS:
            value = row.get(c)
            cells.append("-" if value is None else f"{value:.3f}" if isinstance(value, float)
                         else str(value))
        table.add_row(*cells)
    return table


def usage(
    owner: Annotated[str | None, typer.Option(help="One user's usage (admins; others see "
                                              "only their own).")] = None,
    model: Annotated[str | None, typer.Option(help="One model's usage.")] = None,
    since: Annotated[str, typer.Option(help="From this long ago (30m, 24h, 7d) or this time "
                                       "(ISO 8601, unix seconds).")] = "24h",
    group_by: Annotated[str, typer.Option("--group-by", help="Any of hour, day, user, model, "
                                          "api, token, comma-separated.")] = "user,model",
    as_csv: Annotated[bool, typer.Option("--csv", help="Print CSV.")] = False,
    url: Annotated[str, typer.Option("--url", envvar="MODELYARD_URL",
                                     help="The modelyard front to ask.")] = default_url(),
) -> None:
    """Token usage per user and model (GET /v1/usage): requests, errors, prompt tokens (cached
    ones included), cached, completion tokens, mean time to first token and duration."""

    params = {"start": since_start(since, time.time()), "group_by": group_by,
              "format": "csv" if as_csv else "json"}
    if owner is not None:
        params["owner"] = owner
    if model is not None:
        params["model"] = model
    try:
        r = httpx.get(url.rstrip("/") + "/v1/usage", params=params, headers=auth_headers(),
                      timeout=30.0)
    except httpx.HTTPError as exc:
        err_console.print(f"cannot reach modelyard at {url}: {exc}")
        raise typer.Exit(1) from exc
    if r.status_code >= 400:
        try:
            error = r.json().get("error")
            message = error.get("message") if isinstance(error, dict) else str(error)
        except ValueError:
            message = r.text
        err_console.print(f"[red]error:[/red] {message}")
        raise typer.Exit(1)
    if as_csv:
        typer.echo(r.text, nl=False)
        return
    console.print(render(r.json()))
