"""The Web Studio: its page, its static assets and the live feed its dashboard draws.

    GET /, GET /login             the single-page shell (it holds no data: it asks /auth/me)
    GET /studio/assets/{path}     HTML/CSS/JS shipped inside the package (no build step)
    GET /studio/events            SSE: `event: status` every second, the /status body plus
                                  `jobs` (pulls running, queued or ended in the last minute)

The assets live in `modelyard/front/studio/`; a path that leaves that folder is a 404. Every
response here carries SECURITY_HEADERS: a Content-Security-Policy the Studio runs under as it
is (one module script and one stylesheet of its own, no inline script or style attribute, no
eval, styles set through the CSSOM, fetch and EventSource to this server only) and that no
other site may frame (clickjacking), no MIME sniffing, no Referer to other sites.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from modelyard.errors import RouteNotFound
from modelyard.front.identity.principal import owner_key, principal_of
from modelyard.front.ops.jobs import ACTIVE
from modelyard.front.ops.redact import client_status
from modelyard.front.state import FrontState, state_of

STUDIO_DIR = Path(__file__).resolve().parent.parent / "studio"
EVENT_INTERVAL_S = 1.0
# Ended pulls stay in the feed this long, so a page that watched one sees how it ended.
RECENT_JOB_S = 60.0
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".json": "application/json",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".woff2": "font/woff2",
}
CONTENT_SECURITY_POLICY = "; ".join((
    "default-src 'self'", "script-src 'self'", "style-src 'self'", "img-src 'self'",
    "connect-src 'self'", "font-src 'self'", "object-src 'none'", "base-uri 'none'",
    "form-action 'self'", "frame-ancestors 'none'",
))
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",  # frame-ancestors for browsers that predate CSP 2
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # the Studio's URLs (#/archive/…) stay here
}
# The shell and assets change with each release; `no-cache` revalidates instead of serving stale.
NO_CACHE = {"Cache-Control": "no-cache", **SECURITY_HEADERS}


async def root(request: Request) -> Response:
    """The Studio for a browser; for anything else (`curl`, Ollama's clients probing the
    server, a HEAD) what Ollama answers there: they check for this text."""
    if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
        return await shell(request)
    return PlainTextResponse("Ollama is running", headers=SECURITY_HEADERS)


async def shell(request: Request) -> Response:
    return FileResponse(STUDIO_DIR / "index.html", media_type=MEDIA_TYPES[".html"],
                        headers=NO_CACHE)


def asset_path(relative: str) -> Path | None:
    """The file `relative` names inside the studio folder; None when it names no file there
    (absent, a folder, an unknown type, or a path that climbs out with `..` or a link)."""
    root = STUDIO_DIR.resolve()
    try:  # is_file raises too for a name the file system refuses (ENAMETOOLONG): still no file
        found = (root / relative).resolve()
        if not found.is_relative_to(root) or not found.is_file():
            return None
    except (OSError, ValueError):
        return None
    return found if found.suffix in MEDIA_TYPES else None


async def asset(request: Request) -> Response:
    relative: str = request.path_params["path"]
    found = asset_path(relative)
    if found is None:
        raise RouteNotFound(f"GET /studio/assets/{relative}: no such Studio asset")
    return FileResponse(found, media_type=MEDIA_TYPES[found.suffix], headers=NO_CACHE)


async def pull_jobs(state: FrontState) -> list[dict[str, Any]]:
    now = time.time()
    return [j for j in await state.catalog.jobs.list()
            if j["status"] in ACTIVE or now - (j.get("finished_at") or 0.0) < RECENT_JOB_S]


def sse(event: str, payload: Any) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


async def events(request: Request) -> Response:
    state = state_of(request)
    # Pulls are admin business (/jobs is an admin route): others get an empty list, and the
    # status a client sees on GET /status (front/ops/redact.py: no pids, URLs, paths, errors).
    principal = principal_of(request)
    is_admin = principal.can("admin")
    owner = owner_key(principal)

    async def feed() -> AsyncIterator[bytes]:
        yield b"retry: 2000\n\n"  # EventSource reconnects after 2 s if the server goes away
        while not await request.is_disconnected():
            jobs = await pull_jobs(state) if is_admin else []
            view = await state.status_view()
            yield sse("status", {"status": view if is_admin else client_status(view, owner),
                                 "jobs": jobs})
            await asyncio.sleep(EVENT_INTERVAL_S)

    return StreamingResponse(feed(), media_type="text/event-stream",
                             headers={**NO_CACHE, "X-Accel-Buffering": "no"})


routes = [
    Route("/", root, methods=["GET"]),
    Route("/login", shell, methods=["GET"]),
    Route("/studio/assets/{path:path}", asset, methods=["GET"]),
    Route("/studio/events", events, methods=["GET"]),
]
