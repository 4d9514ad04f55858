"""The engine: owns one device's models, loads them on demand and hands out leases.

All state here is mutated only from the engine's event loop, so there is one owner (DESIGN.md
§3.1) without locks. A burst of requests for a cold model joins one load task (§3.5); a failed load
puts the model in a cooldown so clients get a fast, explained 503 instead of a retry storm; a
model counts as busy exactly while it has leases (§3.3), which the scheduler of a later step uses
to never evict a model with requests in flight (§3.4).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from modelyard.config import LlamaCppModel, ModelSpec, Settings
from modelyard.engine.backends.openai_server import ChildServer
from modelyard.errors import ModelLoadFailed, ModelyardError
from modelyard.store.estimate import MemoryEstimate, estimate_gguf
from modelyard.store.gguf import GgufError, read_gguf_info
from modelyard.store.registry import Entry, ModelRegistry
from modelyard.types import Lease

log = logging.getLogger("modelyard.engine")


class ModelState(StrEnum):
    STOPPED = "stopped"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"


@dataclass
class _Runtime:
    entry: Entry
    state: ModelState = ModelState.STOPPED
    server: ChildServer | None = None
    load: asyncio.Task[None] | None = None
    leases: set[str] = field(default_factory=set)
    cooldown_until: float = 0.0
    last_error: ModelyardError | None = None
    loaded_at: float | None = None
    load_duration_s: float | None = None
    last_used: float = 0.0
    restarts: int = 0
    estimate: MemoryEstimate | None = None


class Engine:
    def __init__(
        self,
        settings: Settings,
        registry: ModelRegistry,
        *,
        index: int = 0,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.index = index
        self.env = env
        self.clock = clock
        self._models: dict[str, _Runtime] = {}
        self._leases: dict[str, str] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.started_at = time.time()

    def _runtime(self, entry: Entry) -> _Runtime:
        rt = self._models.get(entry.id)
        if rt is None:
            rt = self._models[entry.id] = _Runtime(entry)
        return rt

    async def acquire(self, name: str) -> Lease:
        """A lease on a ready copy of `name`, loading it first if needed."""
        rt = self._runtime(self.registry.resolve(name))
        started = self.clock()
        if rt.state is ModelState.READY and rt.server is not None and not rt.server.process.alive:
            # It died and the exit watcher has not run yet: reload instead of leasing a corpse.
            self._forget_dead_server(rt, rt.server)
        while rt.state is not ModelState.READY:
            if rt.load is None:
                self._check_cooldown(rt)
                rt.load = self._spawn(self._load(rt), f"load:{rt.entry.id}")
            await asyncio.shield(rt.load)
        assert rt.server is not None
        lease = Lease(
            id=uuid.uuid4().hex,
            model=rt.entry.id,
            upstream=rt.server.url,
            load_duration_ns=int((self.clock() - started) * 1e9),
        )
        rt.leases.add(lease.id)
        self._leases[lease.id] = rt.entry.id
        return lease

    def release(self, lease_id: str) -> None:
        model_id = self._leases.pop(lease_id, None)
        if model_id is None:
            return
        rt = self._models[model_id]
        rt.leases.discard(lease_id)
        rt.last_used = self.clock()

    def _check_cooldown(self, rt: _Runtime) -> None:
        remaining = rt.cooldown_until - self.clock()
        if remaining <= 0 or rt.last_error is None:
            return
        err = rt.last_error
        raise type(err)(
            f"{err.message} (not retried for another {remaining:.0f} s: load_cooldown_s)",
            model=rt.entry.id,
            retry_after_s=remaining,
            log_tail=err.log_tail,
        )

    async def _load(self, rt: _Runtime) -> None:
        rt.state = ModelState.LOADING
        started = self.clock()
        if rt.estimate is None:
            rt.estimate = await asyncio.to_thread(estimate_model, rt.entry.spec, self.settings)
        try:
            spec = rt.entry.spec
            server = ChildServer(spec, self.settings, env=self.env)
            log.info("loading %s: %s", spec.id, " ".join(server.process.argv))
            await server.start()
        except ModelLoadFailed as exc:
            rt.state = ModelState.FAILED
            rt.last_error = exc
            rt.cooldown_until = self.clock() + self.settings.load_cooldown_s
            exc.retry_after_s = self.settings.load_cooldown_s or None
            log.warning("%s", exc.full_message())
            raise
        except BaseException:
            rt.state = ModelState.STOPPED
            raise
        finally:
            rt.load = None
        rt.server = server
        rt.state = ModelState.READY
        rt.last_error = None
        rt.loaded_at = time.time()
        rt.load_duration_s = self.clock() - started
        log.info("%s ready on %s in %.2f s", spec.id, server.url, rt.load_duration_s)
        self._spawn(self._watch_exit(rt, server), f"watch:{spec.id}")

    async def _watch_exit(self, rt: _Runtime, server: ChildServer) -> None:
        await server.wait_exit()
        self._forget_dead_server(rt, server)

    def _forget_dead_server(self, rt: _Runtime, server: ChildServer) -> None:
        if rt.server is not server or rt.state is not ModelState.READY:
            return
        # It died on its own: the next request reloads it; streams in flight see the drop.
        log.warning(
            "%s exited unexpectedly with status %s; last lines:\n%s",
            rt.entry.id,
            server.process.returncode,
            "\n".join(server.process.tail(self.settings.log_tail_lines)),
        )
        rt.server = None
        rt.state = ModelState.STOPPED
        rt.restarts += 1

    async def _stop(self, rt: _Runtime) -> bool:
        server = rt.server
        if server is None:
            return False
        rt.state = ModelState.STOPPING
        rt.server = None
        await server.stop()
        rt.state = ModelState.STOPPED
        return True

    async def shutdown(self) -> None:
        for rt in self._models.values():
            if rt.load is not None:
                rt.load.cancel()
        await asyncio.gather(*(self._stop(rt) for rt in self._models.values()))
        for task in list(self._tasks):
            task.cancel()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        # Load failures are reported to every waiter; retrieving here keeps asyncio quiet
        # when all of them have gone.
        if not task.cancelled():
            task.exception()

    def status(self) -> dict[str, Any]:
        return {
            "engine": self.index,
            "pid": os.getpid(),
            "started_at": self.started_at,
            "models": self.model_status(),
        }

    def model_status(self) -> list[dict[str, Any]]:
        out = []
        for rt in self._models.values():
            server = rt.server
            out.append(
                {
                    "model": rt.entry.id,
                    "backend": rt.entry.spec.backend,
                    "state": str(rt.state),
                    "pid": server.process.pid if server else None,
                    "upstream": server.url if server else None,
                    "leases": len(rt.leases),
                    "loaded_at": rt.loaded_at if server else None,
                    "load_duration_s": rt.load_duration_s,
                    "size_bytes": rt.entry.size_bytes,
                    "memory": {
                        "estimate_bytes": rt.estimate.total_bytes if rt.estimate else None,
                        "estimate": rt.estimate.to_json() if rt.estimate else None,
                        "measured_bytes": server.process.memory_bytes() if server else None,
                    },
                    "restarts": rt.restarts,
                    "last_error": rt.last_error.message if rt.last_error else None,
                    "cooldown_s": max(0.0, rt.cooldown_until - self.clock()) or None,
                }
            )
        return out


def estimate_model(spec: ModelSpec, settings: Settings) -> MemoryEstimate | None:
    """What serving `spec` should take, from its GGUF header; None when it cannot be told."""
    if not isinstance(spec, LlamaCppModel):
        return None
    try:
        return estimate_gguf(
            read_gguf_info(spec.path),
            ctx_size=spec.ctx_size or settings.default_ctx_size,
            parallel=settings.llama_server_parallel,
            mmproj_path=spec.mmproj,
        )
    except (GgufError, ValueError, OSError) as exc:
        log.warning("no memory estimate for %s: %s", spec.id, exc)
        return None
