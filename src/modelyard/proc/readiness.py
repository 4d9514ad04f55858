"""Readiness of a child server (DESIGN.md §3.6): health poll + exit watch + stall deadline.

A loading server is ready when its health route answers 200. It has failed when it exits, when it
stays silent and unready for `stall_timeout_s` (the deadline moves forward whenever its output
grows, so a big model that keeps logging progress is never cut short), or when `total_timeout_s`
passes whatever it prints.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass
class NotReady(Exception):
    reason: str

    def __str__(self) -> str:
        return self.reason


async def wait_ready(
    *,
    probe: Callable[[], Awaitable[bool]],
    exit_code: Callable[[], int | None],
    progress: Callable[[], int],
    stall_timeout_s: float,
    total_timeout_s: float,
    poll_interval_s: float = 0.05,
    watch_interval_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Return once `probe()` is true; raise NotReady with the reason otherwise.

    `probe()` runs every `poll_interval_s`; with `watch_interval_s`, the exit code and the
    output are also looked at that often, and output that grew since the last probe is probed
    at once: a server logs the line that says it listens as it becomes ready, so a cold request
    waits for that line, not for the rest of a poll interval (a stat costs far less than a
    health request, which is why the poll itself stays slower)."""
    start = clock()
    seen = progress()
    stall_deadline = start + stall_timeout_s
    last_probe: float | None = None
    probed_output = seen
    while True:
        code = exit_code()
        if code is not None:
            raise NotReady(f"exited with status {code} while loading")
        now = clock()
        output = progress()
        if (watch_interval_s is None or last_probe is None or output != probed_output
                or now - last_probe >= poll_interval_s):
            probed_output = output
            if await probe():
                return
            last_probe = now = clock()
        if progress() != seen:
            seen = progress()
            stall_deadline = now + stall_timeout_s
        if now >= start + total_timeout_s:
            raise NotReady(f"not ready after {total_timeout_s:g} s")
        if now >= stall_deadline:
            raise NotReady(f"stalled: no output and not ready for {stall_timeout_s:g} s")
        await asyncio.sleep(poll_interval_s if watch_interval_s is None else watch_interval_s)
