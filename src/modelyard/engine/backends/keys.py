"""A random API key per model load (DESIGN.md §3.12): model servers bind the node address, so
without one any process on the machine — or, in a cluster, on the network — could call a backend
directly and skip modelyard's auth, queues and leases.

The key goes to the server the way nobody else can read it: llama-server reads it from a private
file (`--api-key-file`, 0600 from its first byte, removed when the load ends or its server exits;
the file's name carries the engine's pid, so the files of an engine that was killed, whose servers
died with it, are swept when an engine next starts on the home), vLLM and other children
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

import psutil
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


def key_file(home: Path, name: str) -> Path:
    """A fresh key file's path for a load of `name` (a file-safe model id), owned by this
    process (the engine): `<name>-<random>.<pid>.key`."""
    return key_dir(home) / f"{name}-{secrets.token_hex(6)}.{os.getpid()}.key"


def _owner_gone(path: Path) -> bool:
    """Whether the engine that wrote `path` is gone: no such pid, or a process that started
    after the file was written holds it now (the pid was reused). A name without a pid (written
    before names carried one) has no owner left to ask."""
    pid = path.name.removesuffix(".key").rpartition(".")[2]
    if not pid.isdigit():
        return True
    try:
        return psutil.Process(int(pid)).create_time() > path.stat().st_mtime + 1
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return True
    except (psutil.Error, OSError):  # not ours to see, or the file went meanwhile: keep
        return False


def sweep_stale_keys(home: Path) -> int:
    """Remove the key files of engines that are gone (killed: their servers died with them and
    nobody removed their keys); the number removed. Files of live engines stay: several engines
    share the directory."""
    removed = 0
    for path in key_dir(home).glob("*.key"):
        if _owner_gone(path):
            remove_key_file(path)
            removed += 1
    return removed


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
