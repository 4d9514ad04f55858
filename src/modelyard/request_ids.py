"""Request ids and the log formats that carry them.

Every public request gets an id (the client's `X-Request-Id` when it is a sane token, else a new
one); it is answered in the response's `X-Request-Id`, sent to the engine with the lease request
and to the backend as `X-Request-Id`, and added to every log record written while the request is
being served — in the front and in the engine — so one grep follows a request everywhere.

Logs are text by default (`2026-11-22 07:20:14,123 INFO modelyard.front: message request_id=…`)
or one JSON object per line with `--log-format json`. The JSON formatter is a few lines over
orjson: python-json-logger would add a dependency for what `json.dumps(record fields)` does.
"""

from __future__ import annotations

import logging
import os
import re
from contextvars import ContextVar
from datetime import UTC, datetime

import orjson

HEADER = "X-Request-Id"
REQUEST_ID: ContextVar[str | None] = ContextVar("modelyard_request_id", default=None)
_SANE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(request_tag)s"


def new_id() -> str:
    return os.urandom(8).hex()  # secrets.token_hex's bytes, without its indirections (per request)


def accept(offered: str | None) -> str:
    """The client's id when it is a short plain token (it goes into logs), else a new one."""
    return offered if offered and _SANE.match(offered) else new_id()


def outgoing_headers() -> dict[str, str]:
    """What to add to a request modelyard makes on behalf of the current one."""
    rid = REQUEST_ID.get()
    return {HEADER: rid} if rid else {}


class RequestIdFilter(logging.Filter):
    """Puts the current request's id on every record (`request_id`, `request_tag`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = REQUEST_ID.get()
        record.request_id = rid
        record.request_tag = f" request_id={rid}" if rid else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, request_id (+ exc_info)."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "process": self.process,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
        }
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def handler_setup(handler: logging.Handler, log_format: str, process: str) -> None:
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter(process) if log_format == "json"
                         else logging.Formatter(TEXT_FORMAT))
