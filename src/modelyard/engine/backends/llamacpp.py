"""The llama.cpp backend: the command line that serves one GGUF model with `llama-server`."""

from __future__ import annotations

from pathlib import Path

from modelyard.config import LlamaCppModel, Settings
from modelyard.errors import BackendUnavailable

# One slot per request stream would cap concurrency; llama-server's default (auto) parallel
# slots with unified KV keep continuous batching while honouring the context size per request.
DEFAULT_ARGV = [
    "$llama_server",
    "--model", "$path",
    "--host", "$host",
    "--port", "$port",
    "--alias", "$id",
    "--ctx-size", "$ctx",
    "--jinja",
    "--no-webui",
]


def llama_server_argv(spec: LlamaCppModel, settings: Settings) -> tuple[list[str], dict[str, str]]:
    """The argv template and the values it needs (apart from `$port`, chosen at start)."""
    binary = settings.resolve_llama_server()
    uses_binary = spec.argv is None or any("$llama_server" in a for a in spec.argv)
    if binary is None and uses_binary:
        wanted = settings.llama_server_path or "llama-server"
        raise BackendUnavailable(
            f"no llama-server binary for GGUF model '{spec.id}': {wanted} not found. Run "
            "`make run` (it builds one) or set `llama_server_path` to your own build.",
            model=spec.id,
        )
    argv = list(spec.argv or DEFAULT_ARGV)
    if spec.argv is None:
        if spec.mmproj is not None:
            argv += ["--mmproj", "$mmproj"]
        if settings.llama_server_threads is not None:
            argv += ["--threads", str(settings.llama_server_threads)]
    values = {
        "llama_server": str(binary or ""),
        "path": str(spec.path),
        "mmproj": str(spec.mmproj or ""),
        "id": spec.id,
        "ctx": str(spec.ctx_size or settings.default_ctx_size),
    }
    return argv + spec.extra_args, values


def binary_version(binary: Path) -> str | None:
    """`llama-server --version` output's first line (for /diag)."""
    import subprocess

    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (done.stdout + done.stderr).strip().splitlines()
    return next((ln for ln in lines if "version" in ln), lines[0] if lines else None)
