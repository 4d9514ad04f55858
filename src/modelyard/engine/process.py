"""A supervised child process: its own process group, its logs, and a teardown that escalates.

Used for llama-server and other child servers inside an engine, and for engine processes under the
front. The child runs in a new session so TERM/KILL reach everything it spawned, and on Linux it
dies with its parent (PR_SET_PDEATHSIG) so a crashed supervisor leaves no orphan holding memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: async-signal-safe work only.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ChildProcess:
    """One child process whose output is kept as a ring buffer and appended to a log file."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str,
        log_file: Path | None = None,
        tail_lines: int = 40,
        env: Mapping[str, str] | None = None,
        on_output: Callable[[], None] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.name = name
        self.log_file = log_file
        self.env = dict(env) if env is not None else None
        self.tail: deque[str] = deque(maxlen=tail_lines)
        # Progress for stall deadlines: loaders print dots and carriage returns, not just lines.
        self.bytes_seen = 0
        # Called after each chunk of output; readiness sets it while loading and clears it after.
        self.on_output = on_output
        self._proc: asyncio.subprocess.Process | None = None
        self._pump: asyncio.Task[None] | None = None
        self.started_at = 0.0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        self.started_at = time.monotonic()
        self._pump = asyncio.create_task(self._pump_output(), name=f"pump:{self.name}")

    async def _pump_output(self) -> None:
        """Copy output to the log file a chunk at a time and keep the last lines in memory.

        llama-server logs several lines per request: per-line work here was most of the engine's
        CPU per request, CPU that a busy 2-core host takes straight from inference.
        """
        assert self._proc is not None and self._proc.stdout is not None
        stdout = self._proc.stdout
        log = self.log_file.open("ab") if self.log_file else None
        partial = b""
        try:
            while chunk := await stdout.read(1 << 16):
                self.bytes_seen += len(chunk)
                if log is not None:
                    log.write(chunk)
                    log.flush()
                lines = (partial + chunk).split(b"\n")
                partial = lines.pop()
                keep = lines[-(self.tail.maxlen or len(lines)) :]
                self.tail.extend(ln.decode("utf-8", "replace").rstrip() for ln in keep)
                if self.on_output is not None:
                    self.on_output()
            if partial:
                self.tail.append(partial.decode("utf-8", "replace").rstrip())
        finally:
            if log is not None:
                log.close()

    async def wait(self) -> int:
        assert self._proc is not None
        return await self._proc.wait()

    def _signal_group(self, sig: signal.Signals) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    async def stop(self, grace_s: float, drain_s: float = 2.0) -> int | None:
        """TERM the group, wait `grace_s`, KILL it, then drain the pipe for at most `drain_s`."""
        if self._proc is None:
            return None
        if self._proc.returncode is None:
            self._signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(self._proc.wait(), grace_s)
            except TimeoutError:
                self._signal_group(signal.SIGKILL)
                await self._proc.wait()
        # Grandchildren may still hold the pipe open; never let them block teardown.
        self._signal_group(signal.SIGKILL)
        if self._pump is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._pump), drain_s)
            except TimeoutError:
                self._pump.cancel()
        return self._proc.returncode
