"""The llama.cpp backend: the command line that serves one GGUF model with `llama-server`."""

from __future__ import annotations

from pathlib import Path

from modelyard.config import LlamaCppModel, Settings
from modelyard.errors import BackendUnavailable
from modelyard.store.kinds import gguf_kind
from modelyard.store.registry import served_name

# Fixed slots, each with its own KV cache of the full context (as Ollama's num_parallel does):
# llama-server's default (automatic slots sharing one unified cache) kept discarding cached prompts
# once more requests than slots were in flight — 7 req/s at 8 concurrent 1-token requests on the
# demo model against 59 with this layout. `$ctx_total` is the context times the slots.
# `--slot-save-path` lets the front save a chat session's KV after each turn and restore it into
# the session's slot before the next (front/chat/sessions/kv.py): ~15 ms against seconds of prefill.
DEFAULT_ARGV = [
    "$llama_server",
    "--model", "$path",
    "--host", "$host",
    "--port", "$port",
    "--alias", "$id",
    "--ctx-size", "$ctx_total",
    "--parallel", "$parallel",
    "--no-kv-unified",
    "--jinja",
    "--no-webui",
    "--slot-save-path", "$slot_dir",
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
        if spec.chat_template_file is not None:
            argv += ["--chat-template-file", "$chat_template"]
        if settings.llama_server_threads is not None:
            argv += ["--threads", str(settings.llama_server_threads)]
        # An embedding or reranking GGUF (its pooling type, store/kinds.py) needs the matching
        # mode, or llama-server answers /v1/embeddings and /v1/rerank with a 501.
        kind = gguf_kind(spec.path)
        if kind == "embedding":
            argv += ["--embeddings"]
        elif kind == "rerank":
            argv += ["--reranking"]
    ctx = spec.ctx_size or settings.default_ctx_size
    values = {
        "llama_server": str(binary or ""),
        "path": str(spec.path),
        "mmproj": str(spec.mmproj or ""),
        "chat_template": str(spec.chat_template_file or ""),
        "slot_dir": str(settings.session_kv_dir),
        "id": served_name(spec.id),
        "ctx": str(ctx),
        "parallel": str(settings.llama_server_parallel),
        "ctx_total": str(ctx * settings.llama_server_parallel),
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
