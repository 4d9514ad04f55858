"""One front per MODELYARD_HOME, one engine per index in it (issue 31).

A home is one front's: its SQLite database, its logs, its `front-id` (which pull-job claims and
sessions are keyed by, even on a shared PostgreSQL database), its engines' `run/` files and its
`cli-token`. A second front started on the same home used to come up silently beside the first,
both writing all of that. Several fronts on one PostgreSQL database each keep their own home
(docs/teams.md), so a lock per home stops only the mistake.

The lock is the kernel's (`flock` on `run/front.lock`, `run/engine-N.lock`), held by an open
descriptor for the process's whole life: it goes away with the process however it ends (a
SIGKILL included), so a stale lock file never blocks a restart. The file says who holds it, for
the refusal's message. The descriptor is close-on-exec, so children (engines, llama-server) do
not keep it after their parent is gone.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path


class HomeBusy(Exception):
    """Another live process holds the lock; the message names it as it described itself."""


_held: list[int] = []  # descriptors kept open (and so locked) until the process ends


def hold(path: Path, owner: str, *, wait_s: float = 0.0) -> None:
    """Take the lock at `path` for this process's life, recording `owner` (its pid and address)
    in the file; HomeBusy, naming the holder, when another process still has it after `wait_s`
    (an engine restarted at once may find its predecessor still dying)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            holder = os.read(fd, 4096).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise HomeBusy(f"{holder} holds {path}") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}, {owner}\n".encode())
    _held.append(fd)


def join(path: Path, fd: int) -> None:
    """A worker of `serve --workers N` shares its supervisor's lock on `path`: it inherited
    the supervisor's locked descriptor `fd` (the supervisor's token names it). Proof that it
    is that lock, not a claim: `fd` must be the file at `path`, and flock on it must succeed
    at once, which it does only on the very open file that holds the lock (any other
    descriptor of the file is refused while the supervisor lives). An unrelated second `serve`
    has no such descriptor, takes `hold`, and is refused. HomeBusy when the proof fails."""
    try:
        mine, there = os.fstat(fd), os.stat(path)
        same = (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)
        if same:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (OSError, BlockingIOError):
        same = False
    if not same:
        raise HomeBusy(f"descriptor {fd} is not this process's supervisor's lock on {path}")
    os.set_inheritable(fd, False)  # held for this worker's life; its children do not keep it
    _held.append(fd)


def held_descriptor(path: Path) -> int:
    """The descriptor this process holds its lock on `path` by (for its workers to inherit)."""
    for fd in _held:
        try:
            mine, there = os.fstat(fd), os.stat(path)
        except OSError:
            continue
        if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
            return fd
    raise LookupError(f"this process holds no lock on {path}")
