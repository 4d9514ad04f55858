"""A random API key per model load (DESIGN.md §3.12): model servers bind the node address, so
without one any process on the machine — or, in a cluster, on the network — could call a backend
directly and skip modelyard's auth, queues and leases.

The key goes to the server the way nobody else can read it: llama-server reads it from a private
file (`--api-key-file`, 0600 from its first byte, removed at unload), vLLM and other children
from an environment variable (/proc/PID/environ is the owner's only), the in-process
transformers server checks it itself (`RequireKey`). The lease carries it to the front, which
sends it as `Authorization: Bearer`; the engine's own calls (slot save/restore, /metrics) too.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
from pathlib import Path

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

# Routes a keyed server answers without the key: what readiness probes ask (llama-server's
# own public routes are /health, /v1/health, /models and /v1/models).
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})


def new_key() -> str:
    return secrets.token_urlsafe(32)


def auth_headers(key: str | None) -> dict[str, str]:
    """The header a call to a keyed backend needs (none for a server without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def key_dir(home: Path) -> Path:
    """Where the key files of this home's loads live (0700)."""
    return home / "run" / "backend-keys"


def write_key_file(path: Path, key: str) -> None:
    """`key` in a file only its owner can read, from its first byte (whatever the umask)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")


def remove_key_file(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


class RequireKey:
    """ASGI wrapper: every HTTP request but PUBLIC_PATHS needs `Authorization: Bearer <key>`
    (compared in constant time), else 401 in llama-server's shape."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self._expected):
                body = {"error": {"code": 401, "message": "Invalid API Key",
                                  "type": "authentication_error"}}
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
