"""A supervised child process: its own process group, its log file, and a teardown that escalates.

Used for llama-server and other child servers inside an engine, and for engine processes under the
front. The child runs in a new session so TERM/KILL reach everything it spawned, and on Linux it
dies with its parent (PR_SET_PDEATHSIG) so a crashed supervisor leaves no orphan holding memory.

The child writes its output straight into its log file. Nothing is piped through the supervisor:
llama-server logs about ten lines per request, and relaying them cost the engine more CPU per
request than everything else it does — CPU a small host takes from inference. The file is read
back only when someone needs it: the last lines for an error, its growth as load progress, the
Studio's live logs (front/ops/logs.py).

A log file over `log_max_bytes` is rotated when the child starts (file.log → file.log.1 …, as
logging's RotatingFileHandler names them): the child holds the file open for its whole life, so a
file is only capped between runs, never under a running child.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import psutil

_PR_SET_PDEATHSIG = 1
# Enough for the last few dozen lines of any sane log without reading a big file whole.
_TAIL_READ_BYTES = 256 * 1024


# Loaded once here: dlopen in a freshly forked child is slow and not async-signal-safe.
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def rotate_log(path: Path, max_bytes: int, backups: int) -> None:
    """Move `path` aside when it holds `max_bytes` or more: path.1 … path.N keep the previous
    files (the oldest is dropped; with no backups the file is just emptied). 0 never rotates."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if max_bytes <= 0 or size < max_bytes:
        return
    if backups <= 0:
        path.unlink(missing_ok=True)
        return
    for i in range(backups - 1, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if older.exists():
            older.replace(path.with_name(f"{path.name}.{i + 1}"))
    path.replace(path.with_name(f"{path.name}.1"))


def kill_process_tree(pid: int, *, include_root: bool = True) -> None:
    """SIGKILL `pid` (unless not `include_root`) and every process below it, now: each one, and
    the whole group of each that leads its own (every ChildProcess does), so grandchildren that
    left the tree go too. Nothing gets to clean up: for a process that cannot (wedged), or a
    forced exit."""
    try:
        below = [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        below = []
    own_group = os.getpgrp()
    for target in ([pid] if include_root else []) + below:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if target != own_group and os.getpgid(target) == target:  # a group's leader
                os.killpg(target, signal.SIGKILL)
            os.kill(target, signal.SIGKILL)


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: one plain system call.
    assert _libc is not None
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ChildProcess:
    """One child process whose stdout and stderr go to `log_file` (appended)."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str,
        log_file: Path,
        env: Mapping[str, str] | None = None,
        stdout_pipe: bool = False,
        log_max_bytes: int = 0,
        log_backups: int = 0,
    ) -> None:
        self.argv = list(argv)
        self.log_max_bytes = log_max_bytes  # rotate the log on start beyond this (0: never)
        self.log_backups = log_backups
        self.stdout_pipe = stdout_pipe  # stdout to the caller (a protocol), stderr to the log
        self.name = name
        self.log_file = log_file
        self.env = dict(env) if env is not None else None
        self._proc: asyncio.subprocess.Process | None = None
        self._log_start = 0  # where this run's output begins in the (appended) log file

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
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        rotate_log(self.log_file, self.log_max_bytes, self.log_backups)
        with self.log_file.open("ab") as log:
            self._log_start = log.tell()
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE if self.stdout_pipe else log,
                stderr=log if self.stdout_pipe else asyncio.subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )

    def memory_bytes(self) -> int | None:
        """Resident memory of the process and its children (host RAM; CPU backends)."""
        if self._proc is None or self._proc.returncode is not None:
            return None
        try:
            proc = psutil.Process(self._proc.pid)
            return sum(p.memory_info().rss for p in (proc, *proc.children(recursive=True)))
        except psutil.Error:
            return None

    def output_bytes(self) -> int:
        """How much this run has written: progress, for stall deadlines (dots count too)."""
        try:
            return max(0, self.log_file.stat().st_size - self._log_start)
        except OSError:
            return 0

    def tail(self, lines: int) -> list[str]:
        """The last `lines` lines this run wrote."""
        try:
            with self.log_file.open("rb") as log:
                end = log.seek(0, os.SEEK_END)
                log.seek(max(self._log_start, end - _TAIL_READ_BYTES))
                data = log.read()
        except OSError:
            return []
        text = data.decode("utf-8", "replace").replace("\r", "\n")
        return [ln.rstrip() for ln in text.splitlines() if ln.strip()][-lines:]

    async def stdout_lines(self) -> AsyncIterator[bytes]:
        """Lines the child writes to stdout (with `stdout_pipe`), until it closes it."""
        assert self._proc is not None and self._proc.stdout is not None
        while line := await self._proc.stdout.readline():
            yield line

    def kill(self) -> None:
        """SIGKILL the whole group now (no cleanup in the child)."""
        self._signal_group(signal.SIGKILL)

    def kill_tree(self) -> None:
        """SIGKILL the child and everything below it, its own children's groups included."""
        if self._proc is not None and self._proc.returncode is None:
            kill_process_tree(self._proc.pid)

    async def wait(self) -> int:
        assert self._proc is not None
        return await self._proc.wait()

    def _signal_group(self, sig: signal.Signals) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    async def stop(self, grace_s: float) -> int | None:
        """TERM the group, wait `grace_s`, then KILL it (and whatever it left behind)."""
        if self._proc is None:
            return None
        if self._proc.returncode is None:
            self._signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(self._proc.wait(), grace_s)
            except TimeoutError:
                self._signal_group(signal.SIGKILL)
                await self._proc.wait()
        # Grandchildren may outlive the leader; never let them hold memory or ports.
        self._signal_group(signal.SIGKILL)
        return self._proc.returncode
