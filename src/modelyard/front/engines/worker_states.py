"""`serve --workers N`: each worker process's state, for /status on whichever worker answers.

The supervisor (worker 0, cli/workers.py `WorkerPool`) knows when a worker starts, dies and is
restarted; the other workers do not. It writes what it knows to `run/workers.json` (atomically,
the owner's only) at each change, and /status reads that file: one small read per /status, no
channel between the workers.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from modelyard.config import Settings

WORKERS_FILE = "workers.json"


@dataclass
class WorkerState:
    index: int
    pid: int | None
    alive: bool
    restarts: int = 0  # times this worker was started again after it exited
    started_at: float | None = None  # wall clock
    last_exit: int | None = None  # the exit status of its last exit (negative: a signal)
    last_exit_at: float | None = None


def workers_file(settings: Settings) -> Path:
    return settings.home / "run" / WORKERS_FILE


def write_states(path: Path, states: list[WorkerState]) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump([asdict(s) for s in states], out)
    os.replace(tmp, path)


def read_states(path: Path) -> list[dict[str, object]]:
    """What the supervisor wrote last ([] before it wrote anything, or if unreadable)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [s for s in found if isinstance(s, dict)] if isinstance(found, list) else []
