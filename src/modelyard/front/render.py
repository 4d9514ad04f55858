"""Errors as HTTP responses, in the shape of the API the path belongs to (DESIGN.md §3.8)."""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response

from modelyard.errors import ModelyardError
from modelyard.front.chat import anthropic_shapes


def error_response(path: str, exc: ModelyardError) -> Response:
    if path.startswith(anthropic_shapes.PATH_PREFIX):  # the Anthropic Messages API
        body = anthropic_shapes.error_body(exc)
    elif path.startswith("/v1/"):
        # The service routes (/v1/audio/*, /v1/images/*) too, though their answers are audio or
        # images: the OpenAI SDK reads this envelope on every route (a NotFoundError's `code`).
        body = exc.openai_body()
    elif path.startswith("/api/"):
        body = exc.ollama_body()
    else:
        body = exc.native_body()
    return Response(
        orjson.dumps(body),
        status_code=exc.status,
        headers=exc.headers(),
        media_type="application/json",
    )


def render_error(request: Request, exc: ModelyardError) -> Response:
    return error_response(request.url.path, exc)
