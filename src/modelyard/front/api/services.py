"""Service APIs: /v1/audio/speech, /v1/audio/transcriptions, /v1/images/generations.

Each goes to a registered service (`backend: service`) that declares the route's kind in its
`paths`: it is queued and leased like any model, so the engine has loaded it (its load route) and
evicted what it had to first. The request body goes to the service byte for byte with its
content-type (a multipart upload is never re-encoded: only its `model` field is read here), and
the service's answer comes back unchanged: status, content-type and bytes, 4xx/5xx included.
Errors modelyard raises itself on these routes are in OpenAI's envelope, as on every /v1/ route
(front/render.py): a route no service serves is a 404 `model_not_found`, as OpenAI answers a
model it does not have, so the SDK raises its NotFoundError.
A successful output is also archived, as it streams past (front/archive/capture.py), unless the
request says `X-Modelyard-Archive: off`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from email.message import Message

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard.config import ServiceKind, ServiceModel
from modelyard.errors import InvalidRequest, NoServiceFor, WrongModelKind
from modelyard.front.api.context import context_of
from modelyard.front.archive import capture as archive_capture
from modelyard.front.dispatch.relay import RELAY_ERRORS, LeasedStream, Relay, stream_broke
from modelyard.front.state import FrontState, read_json_object, state_of
from modelyard.store.registry import Entry

log = logging.getLogger("modelyard.front.services")

# Upstream response headers passed to the client with the body (raw bytes need their encoding).
_PASSED_HEADERS = ("content-encoding", "content-length", "content-disposition")


def find_service(state: FrontState, kind: ServiceKind, name: str | None, route: str) -> Entry:
    """The service `name` names, which must serve `kind`; with no name, the only one that does.
    `route` (the request's path) names what nothing serves, when nothing does."""
    serving = [
        e
        for e in state.catalog.registry.entries()
        if isinstance(e.spec, ServiceModel) and kind in e.spec.paths
    ]
    if name is None:
        if len(serving) == 1:
            return serving[0]
        if not serving:
            raise NoServiceFor(route, kind)
        raise InvalidRequest(
            f"`model` is required: name the service for this {kind} request "
            f"({', '.join(e.id for e in serving)})",
            param="model",
        )
    entry = state.catalog.registry.resolve(name)  # an unknown name: 404 model_not_found
    if not isinstance(entry.spec, ServiceModel) or kind not in entry.spec.paths:
        which = ", ".join(e.id for e in serving) or f"no model or service here serves {route}"
        raise WrongModelKind(
            f"model '{entry.id}' does not serve {kind} requests: only a `service` model that "
            f"declares `{kind}` in its `paths` does ({which})",
            param="model",
            model=entry.id,
        )
    return entry


def form_field(body: bytes, content_type: str, name: str) -> str | None:
    """The text of field `name` in a multipart/form-data body (None when absent).

    Only the parts' headers are read; file contents are skipped, not parsed or copied out.
    """
    header = Message()
    header["content-type"] = content_type
    boundary = header.get_param("boundary")
    if header.get_content_type() != "multipart/form-data" or not isinstance(boundary, str):
        raise InvalidRequest(
            "send multipart/form-data (with a boundary) and a `file` field", param="file"
        )
    delimiter = b"--" + boundary.encode("latin-1")
    pos = body.find(delimiter)
    while pos >= 0 and not body.startswith(b"--", pos + len(delimiter)):  # "--": the last one
        start = pos + len(delimiter)
        end = body.find(b"\r\n" + delimiter, start)
        stop = end if end >= 0 else len(body)
        head_end = body.find(b"\r\n\r\n", start, stop)
        if head_end < 0:
            break
        if _part_name(body[start:head_end]) == name:
            return body[head_end + 4 : stop].decode("utf-8", "replace").strip()
        pos = end + 2 if end >= 0 else -1
    return None


def _part_name(head: bytes) -> str | None:
    """The `name` in a part's Content-Disposition header."""
    for line in head.decode("latin-1").split("\r\n"):
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() == "content-disposition":
            disposition = Message()
            disposition["content-disposition"] = value.strip()
            found = disposition.get_param("name", header="content-disposition")
            return found if isinstance(found, str) else None
    return None


async def _json_model(request: Request) -> str | None:
    data = await read_json_object(request)
    model = data.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise InvalidRequest("model: must be a non-empty string", param="model")
    return model


async def _passthrough(relay: Relay) -> AsyncIterator[bytes]:
    """The service's bytes unchanged; a broken upstream aborts the response (there is no framing
    to carry an error event in), so the client sees a truncated body, never a clean end."""
    try:
        async for chunk in relay.iter_chunks():
            yield chunk
    except RELAY_ERRORS as exc:
        error = await stream_broke(relay, exc)
        log.warning("%s", error.message)
        raise error from exc
    finally:
        relay.close()


async def _forward(request: Request, kind: ServiceKind, model: str | None) -> Response:
    state = state_of(request)
    entry = find_service(state, kind, model, request.url.path)
    assert isinstance(entry.spec, ServiceModel)
    body = await request.body()
    ctx = context_of(request)
    # Outputs are archived unless the request says `X-Modelyard-Archive: off` (or the config).
    content_type = request.headers.get("content-type")
    ctx.archive = plan = archive_capture.plan_for(
        state.archive, ctx.principal, request.headers.get(archive_capture.HEADER),
        default_on=state.catalog.settings.archive_service_outputs)
    capture = None if plan is None else archive_capture.ServiceCapture(
        plan, kind=kind, model=entry.id, request_body=body, request_type=content_type or "")
    relay = await state.dispatch.open_relay(
        entry.id,
        entry.spec.paths[kind],
        body,
        priority=ctx.priority,
        content_type="application/json" if content_type is None else content_type,
        client=ctx.receive,  # a client that leaves while it waits (queue, load) leaves the queue
    )
    content = _passthrough(relay)
    if capture is not None and relay.status == 200:
        content = capture.tap(content, relay.content_type)
    response = LeasedStream(content, relay, relay.content_type)
    response.status_code = relay.status
    response.headers["content-type"] = relay.content_type  # as sent: no charset added
    for name in _PASSED_HEADERS:
        value = relay.response.headers.get(name)
        if value is not None:
            response.headers[name] = value
    return response


async def speech(request: Request) -> Response:
    return await _forward(request, "speech", await _json_model(request))


async def transcriptions(request: Request) -> Response:
    body = await request.body()
    model = form_field(body, request.headers.get("content-type", ""), "model")
    return await _forward(request, "transcription", model or None)


async def image_generations(request: Request) -> Response:
    return await _forward(request, "image", await _json_model(request))


routes = [
    Route("/v1/audio/speech", speech, methods=["POST"]),
    Route("/v1/audio/transcriptions", transcriptions, methods=["POST"]),
    Route("/v1/images/generations", image_generations, methods=["POST"]),
]
