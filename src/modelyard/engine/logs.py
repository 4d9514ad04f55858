"""The logs an engine serves (DESIGN.md §3.11: the front never opens an engine's files): each
model's backend log, the file its child server writes (engine/backends/openai_server.py)."""

from __future__ import annotations

from modelyard.config import Settings
from modelyard.engine.backends.openai_server import log_path
from modelyard.proc.logfile import FileLog


def model_log(settings: Settings, model_id: str) -> FileLog:
    """`model_id`'s backend log (it may not exist yet: no lines). Models served inside the
    engine (transformers) log into the engine's own log."""
    return FileLog(log_path(settings, model_id), model_id)
