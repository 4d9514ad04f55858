"""Opt-in capture of an inference request's bodies for the activity view.

On when `activity_capture_bodies` is set (reloadable) or when a request asks with
`X-Modelyard-Capture: on` (its own bodies, archived as its owner's). `begin` is all the metrics
middleware pays when capture is off: one settings read and one header lookup. When on, the
request body is copied as the handler reads it (the middleware wraps `receive`) and the response
as it is sent, each up to `activity_capture_max_bytes` (the rest is counted, not kept). When the
response is over, both are redacted (credentials in JSON fields and in text: wire/logs.py's
`redact`) and saved in the background to the archive as one JSON item of kind `activity`,
owned by the caller, with the archive's retention (the caller's default, else the server's) and
its private files. The activity row links to it by `capture_id`.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from starlette.types import Message, Receive, Scope

from modelyard import metrics as m
from modelyard.front.archive.store import ArchiveStore, NewItem, effective_retention, new_item_id
from modelyard.front.identity.principal import Principal
from modelyard.request_ids import REQUEST_ID
from modelyard.wire.logs import redact

HEADER = b"x-modelyard-capture"
KIND = "activity"
REDACTED = "[redacted]"
# JSON keys whose values are credentials wherever they appear (not `max_tokens`: whole names).
_SECRET_KEY = re.compile(
    r"(?i)^(authorization|proxy-authorization|x-api-key|api[-_]?key|apikey|password|passwd|"
    r"secret|token|access[-_]?token|refresh[-_]?token|id[-_]?token|client[-_]?secret|"
    r"bearer|cookie|.*[-_](secret|password|api[-_]?key|token))$")


def begin(scope: Scope) -> Capture | None:
    """A capture for this request when one is wanted (called by the metrics middleware)."""
    settings = scope["app"].state.front.catalog.settings  # the reloaded settings, each time
    if not wanted(scope, settings.activity_capture_bodies):
        return None
    return Capture(settings.activity_capture_max_bytes)


def finish(state: Any, capture: Capture, principal: Principal | None, path: str,
           request: m.Request) -> None:
    """The response is over: save the bodies in the background and link them to the row."""
    request_id = REQUEST_ID.get()
    item_id = capture.save(state.archive, principal, request_id=request_id, path=path,
                           model=request.model, status=request.status_label)
    state.ops.activity.note_capture(item_id)


def wanted(scope: Scope, enabled: bool) -> bool:
    """Capture this request? The server's option, else the request's own header (`on`)."""
    if enabled:
        return True
    for name, value in scope["headers"]:
        if name == HEADER:
            return bytes(value).strip().lower() in (b"on", b"1", b"true", b"yes")
    return False


class _Bounded:
    """The first `limit` bytes of a body; the size of the rest."""

    __slots__ = ("chunks", "kept", "limit", "total")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.chunks: list[bytes] = []
        self.kept = 0
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.limit - self.kept
        if room > 0 and chunk:
            part = chunk[:room]
            self.chunks.append(part)
            self.kept += len(part)

    def view(self) -> dict[str, Any]:
        data = b"".join(self.chunks)
        truncated = self.total > self.kept
        return {"body": redact_body(data, whole=not truncated), "bytes": self.total,
                "truncated": truncated}


class Capture:
    """The two bodies of one request, bounded."""

    def __init__(self, limit_bytes: int) -> None:
        self.request = _Bounded(limit_bytes)
        self.response = _Bounded(limit_bytes)

    def wrap(self, receive: Receive) -> Receive:
        async def copied() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                self.request.add(message.get("body", b""))
            return message
        return copied

    def on_response(self, chunk: bytes) -> None:
        self.response.add(chunk)

    def document(self, *, request_id: str | None, path: str, model: str,
                 status: str) -> dict[str, Any]:
        return {"request_id": request_id, "path": path, "model": model, "status": status,
                "request": self.request.view(), "response": self.response.view()}

    def save(self, archive: ArchiveStore, principal: Principal | None, *,
             request_id: str | None, path: str, model: str, status: str) -> str:
        """Spawn the archive save; the id it will have (for the activity row)."""
        item_id = new_item_id()
        doc = self.document(request_id=request_id, path=path, model=model, status=status)
        item = NewItem(KIND, orjson.dumps(doc, option=orjson.OPT_INDENT_2), "application/json",
                       f"activity-{request_id or item_id}.json", model=model or None,
                       meta={"request_id": request_id, "path": path, "status": status})
        owner = principal.user if principal is not None else None
        retention = (archive.default_retention if principal is None
                     else effective_retention(None, principal, archive.default_retention))
        archive.spawn(archive.save(owner, retention, item, item_id))
        return item_id


def redact_body(data: bytes, *, whole: bool) -> str:
    """The body as text with its credentials replaced. A whole JSON body is redacted field by
    field (the value of any key that names a credential, at any depth; every string as a log
    line is), so it stays JSON; anything else (a cut body, SSE, text) as text, like a log line."""
    if whole and data[:1] in (b"{", b"["):
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
        else:
            return orjson.dumps(_redact_json(parsed)).decode()
    return redact(data.decode("utf-8", "replace"))


def _redact_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: REDACTED if isinstance(k, str) and _SECRET_KEY.match(k) and v not in (None, "")
                else _redact_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_json(v) for v in value]
    if isinstance(value, str):
        return redact(value)
    return value
