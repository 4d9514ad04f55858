"""Errors as HTTP responses, in the shape of the API the path belongs to (DESIGN.md §3.8)."""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response

from modelyard.errors import ModelyardError
from modelyard.front.chat import anthropic_shapes

# The service APIs (front/api/services.py): errors modelyard raises there are in the native
# shape, since their answers are audio or images, not OpenAI JSON. Here, not in the API module,
# so that rendering an error needs no API (and nothing in the relay imports the routes).
SERVICE_PATH_PREFIXES = ("/v1/audio/", "/v1/images/")


def error_response(path: str, exc: ModelyardError) -> Response:
    if path.startswith(SERVICE_PATH_PREFIXES):
        body = exc.native_body()
    elif path.startswith(anthropic_shapes.PATH_PREFIX):  # the Anthropic Messages API
        body = anthropic_shapes.error_body(exc)
    elif path.startswith("/v1/"):
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
