"""GET /v1/usage: token usage per hour, day, user, model, API or token, as JSON or CSV.

    GET /v1/usage?owner=&model=&start=&end=&group_by=user,model&format=json|csv

`start`/`end` are ISO 8601 (`2026-11-26`, `2026-11-26T10:00:00Z`; no zone: UTC) or unix seconds;
by default the last 24 hours. Rows are hourly sums, so an hour counts when it overlaps the
period. A caller sees their own usage (anonymous callers: the anonymous owner ""); admins see
everyone's, or one owner's with `owner=`. A non-admin naming another owner gets 403 `forbidden`
rather than silently their own rows: a script that asks for someone else's usage learns it
cannot, instead of reading wrong numbers. CSV: `format=csv` or `Accept: text/csv`.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import math
import time
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard.errors import Forbidden, InvalidRequest
from modelyard.front.identity.principal import owner_key, principal_of
from modelyard.front.ops.usage import UsageRecorder
from modelyard.front.ops.usage_store import GROUPS, Query, iso
from modelyard.front.state import state_of

DEFAULT_PERIOD_S = 86400.0
DEFAULT_GROUP_BY = ("user", "model")
NUMBERS = ("requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens",
           "total_tokens", "avg_ttft_s", "avg_duration_s", "avg_queue_wait_s", "swaps")


def recorder_of(request: Request) -> UsageRecorder:
    usage = state_of(request).ops.usage
    if usage is None:  # the lifespan always builds it; a missing one is a wiring bug
        raise RuntimeError("usage accounting is not running")
    return usage


def parse_time(name: str, raw: str) -> float:
    """ISO 8601 (a date, or a date and time; no zone means UTC) or unix seconds."""
    try:
        value = float(raw)
    except ValueError:
        try:
            parsed = dt.datetime.fromisoformat(raw.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            raise InvalidRequest(
                f"{name}: {raw!r} is neither ISO 8601 (2026-11-26T10:00:00Z) nor unix seconds",
                param=name) from None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=dt.UTC)
        value = parsed.timestamp()
    if not math.isfinite(value) or not 0 <= value < 2**40:
        raise InvalidRequest(f"{name}: {raw!r} is out of range", param=name)
    return value


def parse_group_by(raw: str | None) -> tuple[str, ...]:
    if raw is None:
        return DEFAULT_GROUP_BY
    names = tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        raise InvalidRequest(f"group_by: {', '.join(unknown)} not one of {', '.join(GROUPS)}",
                             param="group_by")
    if "hour" in names and "day" in names:
        raise InvalidRequest("group_by: hour or day, not both", param="group_by")
    # The period first, so rows sort by time.
    return tuple(sorted(names, key=lambda n: n not in ("hour", "day")))


def parse_query(request: Request, now: float) -> Query:
    params = request.query_params
    for name in ("owner", "model"):
        if "\x00" in params.get(name, ""):  # PostgreSQL refuses NUL in a text parameter
            raise InvalidRequest(f"{name}: must not contain NUL characters", param=name)
    principal = principal_of(request)
    mine = owner_key(principal)
    owner: str | None = params.get("owner")
    if not principal.is_admin:
        if owner is not None and owner != mine:
            raise Forbidden("owner: you may read only your own usage (admins: anyone's)",
                            param="owner")
        owner = mine
    end = parse_time("end", params["end"]) if params.get("end") else now
    start = parse_time("start", params["start"]) if params.get("start") else \
        end - DEFAULT_PERIOD_S
    if start >= end:
        raise InvalidRequest("start: must be before end", param="start")
    model = params.get("model") or None
    return Query(start, end, owner, model, parse_group_by(params.get("group_by")))


def wants_csv(request: Request) -> bool:
    fmt = request.query_params.get("format")
    if fmt is not None:
        if fmt not in ("json", "csv"):
            raise InvalidRequest(f"format: {fmt!r} is not json or csv", param="format")
        return fmt == "csv"
    accept = request.headers.get("accept", "")
    return "text/csv" in accept and "application/json" not in accept


def to_csv(query: Query, rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    keys = [GROUPS[g][0] for g in query.group_by]
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*keys, *NUMBERS])
    for row in rows:
        writer.writerow(["" if row[k] is None else row[k] for k in (*keys, *NUMBERS)])
    return out.getvalue()


async def get_usage(request: Request) -> Response:
    query = parse_query(request, time.time())
    as_csv = wants_csv(request)
    rows = await recorder_of(request).query(query)
    if as_csv:
        day = iso(query.start)[:10].replace("-", "")
        name = f"modelyard-usage-{day}-{'-'.join(query.group_by) or 'total'}.csv"
        return Response(to_csv(query, rows), media_type="text/csv; charset=utf-8",
                        headers={"Content-Disposition": f'attachment; filename="{name}"'})
    body = {"object": "list", "data": rows, "start": iso(query.start), "end": iso(query.end),
            "group_by": list(query.group_by)}
    return Response(orjson.dumps(body), media_type="application/json")


routes = [Route("/v1/usage", get_usage, methods=["GET"])]
