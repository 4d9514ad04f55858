"""Which server the CLI talks to: `--url`, else $MODELYARD_URL (both typer's), else
$OLLAMA_HOST read as Ollama's own CLI reads it, else modelyard's default address.

A user switching from Ollama has OLLAMA_HOST set for every Ollama tool; honouring it as a
fallback means `modelyard ps` reaches the same server `ollama ps` would.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit

MODELYARD_DEFAULT = "http://127.0.0.1:8770"
OLLAMA_DEFAULT_PORT = 11434


def ollama_host_url(value: str) -> str:
    """OLLAMA_HOST as Ollama's envconfig.Host reads it: `[scheme://]host[:port][/path]`;
    http and port 11434 when left out (80/443 for an explicit http/https without a port)."""
    value = value.strip().strip("\"'")
    scheme, has_scheme, rest = value.partition("://")
    if not has_scheme:
        scheme, rest = "http", value
    parts = urlsplit(f"{scheme}://{rest}")
    default_port = OLLAMA_DEFAULT_PORT
    if has_scheme:
        default_port = {"http": 80, "https": 443}.get(scheme, OLLAMA_DEFAULT_PORT)
    host = parts.hostname or "127.0.0.1"
    try:
        port = parts.port or default_port
    except ValueError:  # not a number: Ollama falls back to its default port too
        port = default_port
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port}{parts.path.rstrip('/')}"


def default_url(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    ollama = env.get("OLLAMA_HOST", "").strip()
    return ollama_host_url(ollama) if ollama else MODELYARD_DEFAULT


def auth_headers() -> dict[str, str]:
    """The CLI authenticates with MODELYARD_TOKEN, else the admin token first boot wrote (in
    $MODELYARD_HOME)."""
    from pathlib import Path

    from modelyard.front.identity.tokens import read_cli_token

    home = Path(os.environ.get("MODELYARD_HOME", Path.home() / ".modelyard")).expanduser()
    token = read_cli_token(home)
    return {"Authorization": f"Bearer {token}"} if token else {}
