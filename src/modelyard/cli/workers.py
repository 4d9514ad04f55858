"""`modelyard serve --workers N`: the supervisor's side (docs/operations.md, workers).

The `serve` process binds the public port N times with SO_REUSEPORT, before any worker runs
(the kernel spreads new connections over the N sockets), serves socket 0 itself as worker 0
(which supervises the engines: front/engines/shared.py) and starts workers 1..N-1 once it
accepts: each is `modelyard serve` again, with the same arguments, inheriting its socket and
the supervisor's locked descriptor on `run/front.lock`, and handed a token in its environment
(TOKEN_ENV, taken out at once so nothing it spawns inherits it): its index, those two
descriptors and the engines' secret. The lock admits it on that descriptor (home_lock.join);
an unrelated `serve` on the same home has none and is refused as before.

A worker that exits while the supervisor runs is restarted (doubling backoff, as engines are),
on the same socket: connections the kernel queued for it wait there meanwhile. The first
SIGTERM/SIGINT the supervisor gets is passed on to every worker (each drains with its grace);
the supervisor waits for them. Workers die with it (PR_SET_PDEATHSIG) if it is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from modelyard import metrics
from modelyard.config import Settings
from modelyard.front.engines.shared import Worker
from modelyard.front.engines.worker_states import WorkerState, workers_file, write_states
from modelyard.proc.process import ChildProcess

log = logging.getLogger("modelyard.workers")

TOKEN_ENV = "MODELYARD_WORKER_TOKEN"
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
HEADER = "X-Modelyard-Worker"  # which worker answered: on every answer when N > 1


@dataclass(frozen=True)
class Token:
    """What a worker is handed (never on its command line: everyone can read that)."""

    index: int
    count: int
    socket_fd: int
    lock_fd: int
    secret: str

    def encode(self) -> str:
        return json.dumps(self.__dict__)

    @property
    def worker(self) -> Worker:
        return Worker(self.index, self.count, self.secret)


def take_token() -> Token | None:
    """This process's worker token, taken out of the environment; None: not a worker."""
    raw = os.environ.pop(TOKEN_ENV, None)
    if raw is None:
        return None
    found = json.loads(raw)
    return Token(int(found["index"]), int(found["count"]), int(found["socket_fd"]),
                 int(found["lock_fd"]), str(found["secret"]))


def bind(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` listening sockets on host:port, SO_REUSEPORT. All bound here, before any worker
    starts; only processes of this user can join such a group (the kernel's rule)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    found = []
    for _ in range(count):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
        found.append(sock)
    return found


def adopt(token: Token) -> socket.socket:
    """A worker's listening socket, from the descriptor it inherited."""
    return socket.socket(fileno=token.socket_fd)


class WorkerPool:
    """Workers 1..N-1 of the supervisor (serving.ServerHooks: started with its server)."""

    def __init__(self, settings: Settings, sockets: list[socket.socket], lock_fd: int,
                 secret: str) -> None:
        self.settings = settings
        self.sockets = sockets
        self.lock_fd = lock_fd
        self.secret = secret
        self.processes: dict[int, ChildProcess] = {}
        # What /status shows of each worker (front/engines/worker_states.py); 0 is this process.
        self.states = {0: WorkerState(0, os.getpid(), True, started_at=time.time())}
        self.states.update({i: WorkerState(i, None, False) for i in range(1, len(sockets))})
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    async def started(self) -> None:
        self._tell()
        for index in range(1, len(self.sockets)):
            self._tasks.append(asyncio.create_task(self._keep(index), name=f"worker-{index}"))

    def stopping(self) -> None:
        self._stopping = True
        for process in self.processes.values():
            if process.alive and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)  # it drains as worker 0 does

    async def stopped(self) -> None:
        """Wait for each worker's own drain (its grace, plus a margin); past that, kill it. A
        second SIGTERM here would force its exit (serving.py), so none is sent."""
        grace = self.settings.shutdown_grace_s + 10.0

        async def end(process: ChildProcess) -> None:
            if process.pid is None:
                return
            try:
                await asyncio.wait_for(process.wait(), grace)
            except TimeoutError:
                process.kill_tree()

        await asyncio.gather(*(end(p) for p in self.processes.values()))
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _spawn(self, index: int) -> ChildProcess:
        sock = self.sockets[index]
        token = Token(index, len(self.sockets), sock.fileno(), self.lock_fd, self.secret)
        env = dict(os.environ)
        env[TOKEN_ENV] = token.encode()
        return ChildProcess(
            [sys.executable, "-m", "modelyard", *sys.argv[1:]], name=f"worker-{index}",
            log_file=self.settings.logs_dir / f"worker-{index}.log", env=env,
            log_max_bytes=self.settings.log_file_max_bytes,
            log_backups=self.settings.log_file_backups,
            pass_fds=(sock.fileno(), self.lock_fd))

    async def _keep(self, index: int) -> None:
        """Run worker `index`; restart it when it exits, until the supervisor stops."""
        backoff = FIRST_BACKOFF_S
        while not self._stopping:
            process = self.processes[index] = self._spawn(index)
            await process.start()
            log.info("worker-%d started (pid %s)", index, process.pid)
            state = self.states[index]
            state.pid, state.alive, state.started_at = process.pid, True, time.time()
            self._tell()
            code = await process.wait()
            if process.pid is not None:
                metrics.process_exited(process.pid)
            state.alive, state.last_exit, state.last_exit_at = False, code, time.time()
            if self._stopping:
                return
            state.restarts += 1
            self._tell()
            log.error("worker-%d exited with status %s; restarting in %.1f s. Last lines:\n%s",
                      index, code, backoff,
                      "\n".join(process.tail(self.settings.log_tail_lines)))
            await asyncio.sleep(backoff)
            backoff = min(MAX_BACKOFF_S, backoff * 2)

    @property
    def restarts(self) -> int:
        """Worker restarts since the supervisor started, all workers together."""
        return sum(state.restarts for state in self.states.values())

    def _tell(self) -> None:
        """Write the workers' states for /status (any worker may answer it)."""
        try:
            write_states(workers_file(self.settings),
                         [self.states[i] for i in sorted(self.states)])
        except OSError as exc:  # a full disk: /status shows the last states written
            log.error("could not write the workers' states: %s", exc)


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def lock_path(settings: Settings) -> Path:
    return settings.home / "run" / "front.lock"
