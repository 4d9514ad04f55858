"""The front's engine supervisor: one engine process per device group (or one CPU engine).

Each engine runs `python -m modelyard serve --engine-only --internal-port N --internal-fd F`
(F: a socket the supervisor bound, which the engine inherits) with its own
CUDA_VISIBLE_DEVICES. The supervisor waits until the engine answers /health, watches its exit,
restarts it with a doubling backoff (its HttpEngineClient answers 503 engine_unavailable in the
meantime), and on shutdown stops it with TERM → grace → KILL.

An engine can also be alive but stuck (wedged: a deadlock, a blocked event loop, SIGSTOP). The
supervisor probes its /health every `engine_health_interval_s`; a probe not answered within
`engine_health_timeout_s` marks it down (its client fails fast instead of hanging), and after
`engine_health_failures` in a row its whole process tree is SIGKILLed — it cannot run a TERM
handler — and it is restarted like a crashed one. Its children die with it: each is killed by
group, and each would die anyway by PR_SET_PDEATHSIG when the engine does.

Each start gets a fresh random secret (DESIGN.md §3.12), in the engine's environment
($MODELYARD_ENGINE_SECRET, readable only by this user; never its command line, which everyone can
read): the engine refuses any HTTP request or lease channel without it. Between probes, the lease
channel's heartbeat (`engine_heartbeat_timeout_s`, front/engines/lease_client.py) finds a silent
engine within seconds and marks it down; the probes still decide when it is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from modelyard import metrics
from modelyard.config import EngineSpec, Settings
from modelyard.errors import EngineProtocolMismatch
from modelyard.placement.groups import device_groups
from modelyard.proc.ports import listening_socket
from modelyard.proc.process import ChildProcess
from modelyard.proc.readiness import NotReady, wait_ready
from modelyard.wire.lease import SECRET_ENV

log = logging.getLogger("modelyard.supervisor")

MAX_BACKOFF_S = 30.0
_NO_SPEC = EngineSpec()


class SupervisedClient(Protocol):
    """Who hears about the supervised engine: the front's `HttpEngineClient`, or a node agent's
    record of its engines (cluster/node_agent.py)."""

    name: str

    async def attach(self, base_url: str, lease_port: int, secret: str, *,
                     report_timeout_s: float | None = None,
                     heartbeat_timeout_s: float = 0.0) -> None: ...

    async def detach(self) -> None: ...

    def refuse(self, why: EngineProtocolMismatch) -> None: ...

    def set_answering(self, answering: bool) -> None: ...


@dataclass(frozen=True)
class EnginePlan:
    index: int
    cuda_visible_devices: str  # "" hides every GPU: a CPU engine


class EngineSupervisor:
    def __init__(
        self,
        settings: Settings,
        plan: EnginePlan,
        client: SupervisedClient,
        *,
        config_file: Path | None = None,
        on_change: Callable[[], None] | None = None,
        secret: str | None = None,
    ) -> None:
        self.settings = settings
        self.plan = plan
        self.client = client
        self.config_file = config_file
        self._on_change = on_change or (lambda: None)  # its engine went up or down
        self.process: ChildProcess | None = None
        self.restarts = 0
        self.wedged = 0  # times it was killed for not answering its health probe
        self._base_url = ""
        # A cluster's engines share the cluster's secret (wire/cluster.py); else one per start.
        self._fixed_secret = secret
        self._secret = ""
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._first_start: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def _argv(self, port: int, fd: int) -> list[str]:
        argv = [
            sys.executable, "-m", "modelyard", "serve", "--engine-only",
            "--internal-port", str(port), "--internal-fd", str(fd),
            "--engine-index", str(self.plan.index),
        ]
        if self.config_file is not None:
            argv += ["--config", str(self.config_file)]
        return argv

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[SECRET_ENV] = self._secret
        env["CUDA_VISIBLE_DEVICES"] = self.plan.cuda_visible_devices
        env["MODELYARD_NODE_ADDRESS"] = self.settings.node_address
        # The engine must build the same settings as the front, including CLI overrides.
        env["MODELYARD_HOME"] = str(self.settings.home)
        if self.settings.simulate_gpus:
            env["MODELYARD_SIMULATE_GPUS"] = self.settings.simulate_gpus
        # Under `serve --workers N` the engine holds `max_queue` for every worker (loop.py).
        env["MODELYARD_WORKERS"] = str(self.settings.workers)
        env.update(self.settings.engine_specs.get(self.plan.index, _NO_SPEC).env)
        return env

    async def start(self) -> None:
        """Start the engine and keep it running; returns once the first start is ready."""
        self._task = asyncio.create_task(self._run(), name=f"supervise:{self.client.name}")
        await self._first_start

    async def _run(self) -> None:
        backoff = self.settings.engine_restart_backoff_s
        while not self._stopping:
            try:
                await self._start_once()
            except EngineProtocolMismatch as exc:
                # Another start of the same program speaks the same version: it stays down.
                log.error("%s: %s; it stays down", self.client.name, exc.message)
                self.client.refuse(exc)
                if not self._first_start.done():
                    self._first_start.set_result(None)
                return
            except (NotReady, OSError) as exc:
                log.error("%s failed to start: %s", self.client.name, exc)
                if not self._first_start.done():
                    self._first_start.set_exception(
                        RuntimeError(f"{self.client.name} failed to start: {exc}")
                    )
                    return
            else:
                if not self._first_start.done():
                    self._first_start.set_result(None)
                backoff = self.settings.engine_restart_backoff_s
                assert self.process is not None
                code = await self._watch(self.process)
                metrics.process_exited(self.process.pid)  # its live gauges go; counters stay
                await self.client.detach()
                self._on_change()
                if self._stopping:
                    return
                log.error(
                    "%s exited with status %s; restarting in %.1f s. Last lines:\n%s",
                    self.client.name,
                    code,
                    backoff,
                    "\n".join(self.process.tail(self.settings.log_tail_lines)),
                )
            self.restarts += 1
            await asyncio.sleep(backoff)
            backoff = min(MAX_BACKOFF_S, max(backoff * 2, 0.5))

    async def _start_once(self) -> None:
        address = self.settings.node_address
        # The engine inherits a socket already listening, not a port number to bind: a port
        # that was free here can be taken (by any connect's ephemeral port) before it binds.
        sock = listening_socket(address)
        port = int(sock.getsockname()[1])
        self._secret = self._fixed_secret or secrets.token_urlsafe(32)
        self.process = ChildProcess(
            self._argv(port, sock.fileno()),
            name=self.client.name,
            log_file=engine_log_path(self.settings, self.client.name),
            env=self._env(),
            log_max_bytes=self.settings.log_file_max_bytes,
            log_backups=self.settings.log_file_backups,
            pass_fds=(sock.fileno(),),
        )
        try:
            await self.process.start()
        finally:
            sock.close()  # the engine holds its own copy; a new start listens anew
        base_url = f"http://{address}:{port}"
        async with httpx.AsyncClient(base_url=base_url, timeout=2.0,
                                     headers=self._auth()) as probe_client:

            lease_port = 0

            async def probe() -> bool:
                nonlocal lease_port
                try:
                    r = await probe_client.get("/health")
                except httpx.HTTPError:
                    return False
                lease_port = int(r.json()["lease_port"]) if r.status_code == 200 else 0
                return lease_port > 0

            try:
                await wait_ready(
                    probe=probe,
                    exit_code=lambda: self.process.returncode if self.process else None,
                    progress=lambda: self.process.output_bytes() if self.process else 0,
                    stall_timeout_s=self.settings.engine_start_timeout_s,
                    total_timeout_s=self.settings.engine_start_timeout_s,
                    poll_interval_s=0.02,
                )
            except NotReady as exc:
                await self.process.stop(self.settings.stop_grace_s)
                tail = "\n".join(self.process.tail(self.settings.log_tail_lines))
                raise NotReady(f"{exc}; last lines:\n{tail}") from exc
        try:
            await self.client.attach(
                base_url, lease_port, self._secret,
                report_timeout_s=self.settings.engine_health_timeout_s,
                heartbeat_timeout_s=self.settings.engine_heartbeat_timeout_s,
            )
        except (OSError, EngineProtocolMismatch):
            await self.process.stop(self.settings.stop_grace_s)  # not left behind unused
            raise
        self._base_url = base_url
        self._on_change()
        log.info("%s ready at %s (pid %s)", self.client.name, base_url, self.process.pid)

    async def _watch(self, process: ChildProcess) -> int:
        """The engine's exit status, once it exits — or once it was killed for not answering
        its health probe."""
        exited = asyncio.ensure_future(process.wait())
        probing = asyncio.ensure_future(self._probe_until_wedged(self._base_url))
        try:
            await asyncio.wait({exited, probing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            probing.cancel()
            if not exited.done():
                exited.cancel()
        if not exited.cancelled() and exited.done():
            return exited.result()
        self.wedged += 1
        log.error("%s (pid %s) is wedged: %s; killing its processes (SIGKILL). Last lines:\n%s",
                  self.client.name, process.pid, probing.result(),
                  "\n".join(process.tail(self.settings.log_tail_lines)))
        process.kill_tree()
        return await process.wait()

    async def _probe_until_wedged(self, base_url: str) -> str:
        """Probe /health until `engine_health_failures` probes in a row fail; returns why.
        Never returns with the probe off (interval 0)."""
        s = self.settings
        if s.engine_health_interval_s <= 0:
            await asyncio.Event().wait()
        failures = 0
        async with httpx.AsyncClient(base_url=base_url, timeout=s.engine_health_timeout_s,
                                     headers=self._auth()) as http:
            while True:
                await asyncio.sleep(s.engine_health_interval_s)  # a wedge sends no event
                try:
                    r = await http.get("/health")
                    why = "" if r.status_code == 200 else f"/health answered {r.status_code}"
                except httpx.TimeoutException:
                    why = f"/health not answered within {s.engine_health_timeout_s:g} s"
                except httpx.HTTPError as exc:
                    why = f"/health failed ({type(exc).__name__})"
                self.client.set_answering(not why)
                if not why:
                    failures = 0
                    continue
                failures += 1
                log.warning("%s: %s (%d of %d)", self.client.name, why, failures,
                            s.engine_health_failures)
                if failures >= s.engine_health_failures:
                    return f"{failures} health probes in a row failed, the last: {why}"

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._secret}"}

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.client.detach()
        if self.process is not None:
            # The engine stops its own children on TERM; give it their grace plus its own.
            await self.process.stop(self.settings.stop_grace_s * 2 + 5)


def engine_log_path(settings: Settings, name: str) -> Path:
    """Where engine `name`'s process writes its stdout and stderr."""
    return settings.logs_dir / f"{name}.log"


def plan_engines(settings: Settings, gpu_count: int) -> list[EnginePlan]:
    """One engine per device group (`engine_devices`: all GPUs by default, one per GPU, or
    explicit groups), its CUDA_VISIBLE_DEVICES the group's indexes; one CPU engine when there
    are no GPUs (or `devices: cpu`).

    Simulated GPUs are grouped the same way, but hide every real GPU from their engines (each
    engine finds its simulated group from the same settings: engine/ledger.py `engine_group`).
    """
    if settings.simulate_gpus:
        groups = device_groups(settings.engine_devices, range(gpu_count))
        return [EnginePlan(i, "") for i in range(len(groups))]
    if settings.devices == "cpu" or gpu_count == 0:
        return [EnginePlan(0, "")]
    groups = device_groups(settings.engine_devices, range(gpu_count))
    return [EnginePlan(i, ",".join(str(d) for d in group)) for i, group in enumerate(groups)]
