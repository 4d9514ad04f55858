"""GGUF read-ahead: while a request waits for a cold llama.cpp model, have the kernel read its
file into the page cache, so the llama-server that maps it (mmap) finds the pages in memory
instead of faulting them in from disk one by one as it loads.

`posix_fadvise(POSIX_FADV_WILLNEED)` starts the reads and returns; the kernel drops the pages
again under memory pressure, so the hint costs nothing that is needed elsewhere. A file larger
than the host's available memory is not hinted: it would only push out other cached pages.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

log = logging.getLogger("modelyard.engine.read_ahead")

# The seam tests inject: os.posix_fadvise's signature (fd, offset, length, advice).
Fadvise = Callable[[int, int, int, int], None]


def _default_fadvise() -> Fadvise | None:
    return getattr(os, "posix_fadvise", None)  # absent on macOS and Windows


def read_ahead(
    paths: Iterable[Path],
    fadvise: Fadvise | None = None,
    *,
    available_bytes: Callable[[], int] = lambda: psutil.virtual_memory().available,
) -> list[Path]:
    """Hint `paths` into the page cache; the paths hinted (runs in a thread: opening a file on a
    slow disk can block)."""
    advise = fadvise or _default_fadvise()
    if advise is None:
        return []
    hinted = []
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            log.debug("read-ahead of %s skipped: %s", path, exc)
            continue
        try:
            if os.fstat(fd).st_size > available_bytes():
                continue
            advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            hinted.append(path)
        except OSError as exc:
            log.debug("read-ahead of %s failed: %s", path, exc)
        finally:
            os.close(fd)
    return hinted
