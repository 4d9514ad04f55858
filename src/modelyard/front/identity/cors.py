"""CORS as Ollama's defaults have it, plus `cors_origins`.

Without configuration, pages served from this machine (http(s)://localhost, 127.0.0.1 and
0.0.0.0, on any port) and desktop-app origins (app://, file://, tauri://, vscode-webview://,
vscode-file://) may call the API from a browser, as Ollama allows them: a local web UI works
unchanged. They get no `Access-Control-Allow-Credentials`, so a page can never read an answer
made with the Studio's login cookie. A page from anywhere else gets no CORS headers at all: the
browser keeps the answer from it (and check_browser_request refuses its state changes).
Origins listed in `cors_origins` widen this, with credentials (they are the operator's own).
"""

from __future__ import annotations

import re

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from modelyard.config import Settings

# Ollama's default OLLAMA_ORIGINS (envconfig.AllowedOrigins), as one pattern.
LOOPBACK_ORIGINS = re.compile(
    r"(https?://(localhost|127\.0\.0\.1|0\.0\.0\.0)(:\d{1,5})?"
    r"|(app|file|tauri|vscode-webview|vscode-file)://[^\s]*)"
)


def is_default_origin(origin: str) -> bool:
    return LOOPBACK_ORIGINS.fullmatch(origin.strip().lower()) is not None


class OllamaCors:
    """Answers preflights and adds CORS headers: configured origins with credentials, the
    default (local) ones without; every other request passes through untouched."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        methods, headers = ["*"], ["*"]
        self.configured = (
            CORSMiddleware(app, allow_origins=settings.cors_origins, allow_credentials=True,
                           allow_methods=methods, allow_headers=headers)
            if settings.cors_origins else None)
        self.listed = {o.rstrip("/") for o in settings.cors_origins}
        self.local = CORSMiddleware(app, allow_origin_regex=LOOPBACK_ORIGINS.pattern,
                                    allow_methods=methods, allow_headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = Headers(scope=scope).get("origin")
        if origin is None:
            await self.app(scope, receive, send)
        elif self.configured is not None and ("*" in self.listed
                                              or origin.rstrip("/") in self.listed):
            await self.configured(scope, receive, send)
        else:
            await self.local(scope, receive, send)
