"""A supervised child process: its own process group, its log file, and a teardown that escalates.

Used for llama-server and other child servers inside an engine, and for engine processes under the
front. The child runs in a new session so TERM/KILL reach everything it spawned, and on Linux it
dies with its parent (PR_SET_PDEATHSIG) so a crashed supervisor leaves no orphan holding memory.

The child writes its output straight into its log file. Nothing is piped through the supervisor:
llama-server logs about ten lines per request, and relaying them cost the engine more CPU per
request than everything else it does — CPU a small host takes from inference. The file is read
back only when someone needs it: the last lines for an error, its growth as load progress, the
Studio's live logs (front/ops/logs.py).

A log file over `log_max_bytes` is rotated (file.log → file.log.1 …, as logging's
RotatingFileHandler names them) when the child starts, and while it runs: the child holds the file
open for its whole life, so renaming the file would leave it writing into file.log.1. Instead the
supervisor copies the full file aside and truncates it in place ("copytruncate", as logrotate
calls it); the child opened it for appending (O_APPEND), so its next write lands at the new end.
Piping the output through the supervisor instead would let it rotate losslessly, but costs the
CPU the paragraph above saves; the price here is that lines written between the copy and the
truncation (microseconds) are lost, once per `log_max_bytes`.
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


# How often a running child's log size is looked at: one stat() a second per child; a child
# that writes faster than the cap per second overshoots it for at most that second.
LOG_CHECK_S = 1.0


def _over(path: Path, max_bytes: int) -> bool:
    try:
        return max_bytes > 0 and path.stat().st_size >= max_bytes
    except FileNotFoundError:
        return False


def _shift_backups(path: Path, backups: int) -> None:
    """path.1 … path.N-1 become path.2 … path.N (the oldest is dropped), freeing path.1."""
    for i in range(backups - 1, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if older.exists():
            older.replace(path.with_name(f"{path.name}.{i + 1}"))


def rotate_log(path: Path, max_bytes: int, backups: int) -> None:
    """Move `path` aside when it holds `max_bytes` or more: path.1 … path.N keep the previous
    files (the oldest is dropped; with no backups the file is just emptied). 0 never rotates.
    For a file no process writes (a child's, before it starts)."""
    if not _over(path, max_bytes):
        return
    if backups <= 0:
        path.unlink(missing_ok=True)
        return
    _shift_backups(path, backups)
    path.replace(path.with_name(f"{path.name}.1"))


def rotate_log_in_place(path: Path, max_bytes: int, backups: int) -> int:
    """`rotate_log` for a file a running process appends to: its bytes are copied to path.1
    (private from its first byte, like the log) and the file is truncated, so the writer's
    descriptor stays valid. The number of bytes moved aside (0: nothing to do)."""
    if not _over(path, max_bytes):
        return 0
    with path.open("rb") as src:
        moved = 0
        if backups > 0:
            _shift_backups(path, backups)
            backup = path.with_name(f"{path.name}.1")
            fd = os.open(backup, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                # Until nothing is left: what the writer adds meanwhile goes along.
                while sent := os.sendfile(fd, src.fileno(), moved, 1 << 24):
                    moved += sent
            finally:
                os.close(fd)
        else:
            moved = os.fstat(src.fileno()).st_size
        os.truncate(path, 0)
    return moved


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
        pass_fds: Sequence[int] = (),
    ) -> None:
        self.argv = list(argv)
        self.pass_fds = tuple(pass_fds)  # descriptors it inherits (a front worker's socket)
        self.log_max_bytes = log_max_bytes  # rotate the log on start beyond this (0: never)
        self.log_backups = log_backups
        self.stdout_pipe = stdout_pipe  # stdout to the caller (a protocol), stderr to the log
        self.name = name
        self.log_file = log_file
        self.env = dict(env) if env is not None else None
        self._proc: asyncio.subprocess.Process | None = None
        self._log_start = 0  # where this run's output begins in the (appended) log file
        self._log_moved = 0  # this run's output that rotations moved out of the file
        self._log_cap: asyncio.Task[None] | None = None

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
                pass_fds=self.pass_fds,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self._log_moved = 0
        if self.log_max_bytes > 0:
            self._log_cap = asyncio.create_task(self._cap_log(self._proc))

    async def _cap_log(self, proc: asyncio.subprocess.Process) -> None:
        """Keep the log under `log_max_bytes` while `proc` runs (the module's docstring)."""
        while True:
            try:
                await asyncio.wait_for(proc.wait(), LOG_CHECK_S)
                return  # it exited: its next start rotates the file
            except TimeoutError:
                pass
            try:
                moved = rotate_log_in_place(self.log_file, self.log_max_bytes, self.log_backups)
            except OSError:
                continue  # a full disk or a file removed under us: try again later
            if moved:
                self._log_moved += max(0, moved - self._log_start)
                self._log_start = 0

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
            return self._log_moved + max(0, self.log_file.stat().st_size - self._log_start)
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
