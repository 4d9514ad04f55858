"""MODELYARD_HOME is the owner's only (DESIGN.md §3.12).

It holds the database (password and token hashes, chat sessions, in its -wal/-shm too), the
logs (prompts can show up there), llama-server's saved chat-session KV (a whole conversation),
the archive, the secret key and the CLI's admin token. `modelyard serve` sets the umask to 077
before it writes anything, so every file it, its engines and their children (llama-server)
create is private from its first byte; `secure` tightens what an older version left readable.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_UMASK = 0o077


def private_umask() -> None:
    """Files created from now on, here and in every child process, are the owner's only."""
    os.umask(PRIVATE_UMASK)


def secure(home: Path, *, skip: tuple[Path, ...] = ()) -> None:
    """Create `home` 0700, and take group/other access off everything under it, except below
    `skip` (model weights: large, public, and unreachable anyway behind a private home).
    Symbolic links are left alone (their targets are not ours to change)."""
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    _tighten(home)
    skipped = {str(p) for p in skip}
    for root, dirs, files in os.walk(home):
        dirs[:] = [d for d in dirs if os.path.join(root, d) not in skipped]
        for name in (*dirs, *files):
            _tighten(Path(root, name))


def _tighten(path: Path) -> None:
    try:
        st = path.lstat()
    except FileNotFoundError:  # gone meanwhile (a rotated log)
        return
    if stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o077:
        return
    path.chmod(stat.S_IMODE(st.st_mode) & ~0o077)
