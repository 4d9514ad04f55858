"""Pull jobs: explicit downloads that run in the background, survive restarts and report progress.

A job is a row in the database and, while it runs, a child process (`modelyard.store.pull`) whose
JSON-line events move the row along. `max_concurrent_pulls` run at once, the rest wait in order.
Two pulls of the same reference while one is queued or running share that job. On startup, jobs
that were queued or running when the last process ended are marked `interrupted`; `resume` puts
one back in the queue, and the download continues where its file stopped.

Several fronts on one database: a job belongs to the front that submitted (or resumed) it
(`claimed_by`, its front id), which renews `claimed_at` every `front_sync_interval_s`
(`heartbeat`); it goes from queued to running by a conditional UPDATE, so exactly one front runs
it. A front starting marks interrupted only its own earlier claims and claims nobody renewed
for `STALE_CLAIMS` intervals (a dead front's), never a live front's job; each heartbeat also
interrupts dead fronts' jobs, so they can be resumed anywhere. A job cancelled on another front
is stopped by its owner at its next heartbeat.

Statuses: queued → running → succeeded | failed | cancelled; interrupted (after a restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import orjson
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from modelyard import db, metrics
from modelyard.config import Settings
from modelyard.errors import InvalidRequest, JobNotFound, ModelyardError
from modelyard.store.refs import parse_ref

log = logging.getLogger("modelyard.jobs")

ACTIVE = ("queued", "running")
FINAL = ("succeeded", "failed", "cancelled", "interrupted")
QUANTIZE = ("auto", "q4", "fp16", "no")
# A 4-bit load is preferred for safetensors models above this size when CUDA is there ([4/7]).
Q4_THRESHOLD_BYTES = 14_000_000_000
# Progress is written to the database at most this often (readers get it live from memory).
DB_PROGRESS_EVERY_S = 1.0
# A claim not renewed for this many `front_sync_interval_s` is a dead front's.
STALE_CLAIMS = 10

OnPulled = Callable[[dict[str, Any]], Awaitable[None]]
CatalogChanged = Callable[[], Awaitable[None]]


class PullChild(Protocol):
    """A pull's child process (proc/process.py `ChildProcess`, given by the front's engine
    provider module: the front imports no process code itself, DESIGN.md §2)."""

    async def start(self) -> None: ...

    def stdout_lines(self) -> AsyncIterator[bytes]: ...

    async def wait(self) -> int: ...

    async def stop(self, grace_s: float) -> int | None: ...

    def kill(self) -> None: ...

    def tail(self, lines: int) -> list[str]: ...


class SpawnChild(Protocol):
    def __call__(self, argv: list[str], *, name: str, log_file: Path,
                 stdout_pipe: bool) -> PullChild: ...


class PullJobs:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        *,
        catalog_changed: CatalogChanged,
        on_pulled: OnPulled,
        spawn: SpawnChild,
        pulled_with: OnPulled | None = None,
        front_id: str = "front",
    ) -> None:
        self.settings = settings
        self.front_id = front_id  # what `claimed_by` says for the jobs this front owns
        # Before a job reads succeeded: what comes with its model (a speculative-decoding
        # draft, front/ops/draft_pulls.py) is submitted, so a client that saw the success sees
        # that job too.
        self.pulled_with = pulled_with
        self._spawn = spawn
        self.db = engine
        self.catalog_changed = catalog_changed
        self.on_pulled = on_pulled  # after success: e.g. load it (`init`)
        self._slots = asyncio.Semaphore(settings.max_concurrent_pulls)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._children: dict[str, PullChild] = {}
        self._live: dict[str, dict[str, Any]] = {}  # running jobs, fresher than the database
        self._changed: dict[str, asyncio.Event] = {}

    # ---- database -------------------------------------------------------------------------

    async def _q(self, fn: Callable[[sa.Connection], Any]) -> Any:
        def run() -> Any:
            with self.db.begin() as conn:
                return fn(conn)

        return await asyncio.to_thread(run)

    async def _update(self, job_id: str, **fields: Any) -> None:
        if fields.get("status") in FINAL:
            metrics.pull_finished(fields["status"])
        live = self._live.get(job_id)
        if live is not None:
            live.update(fields)
        await self._q(lambda c: c.execute(
            sa.update(db.jobs).where(db.jobs.c.id == job_id).values(**fields)
        ))
        self._notify(job_id)

    def _notify(self, job_id: str) -> None:
        event = self._changed.pop(job_id, None)
        if event is not None:
            event.set()

    async def recover(self) -> int:
        """After a restart: what was queued or running is interrupted (resumable): our own
        earlier claims, unclaimed jobs, and claims another front stopped renewing."""
        stale = time.time() - STALE_CLAIMS * self.settings.front_sync_interval_s
        c = db.jobs.c
        result = await self._q(lambda conn: conn.execute(
            sa.update(db.jobs).where(c.status.in_(ACTIVE), sa.or_(
                c.claimed_by.is_(None), c.claimed_by == self.front_id,
                c.claimed_at.is_(None), c.claimed_at < stale))
            .values(status="interrupted", finished_at=time.time(),
                    error="modelyard stopped while this pull was unfinished; resume it")
        ))
        return int(result.rowcount or 0)

    async def heartbeat(self) -> None:
        """Renew this front's claims; interrupt a dead front's jobs (claims nobody renewed);
        stop a job of ours that another front cancelled."""
        c = db.jobs.c
        stale = time.time() - STALE_CLAIMS * self.settings.front_sync_interval_s

        def renew(conn: sa.Connection) -> list[str]:
            conn.execute(sa.update(db.jobs).where(
                c.claimed_by == self.front_id, c.status.in_(ACTIVE)
            ).values(claimed_at=time.time()))
            conn.execute(sa.update(db.jobs).where(
                c.status.in_(ACTIVE), c.claimed_by != self.front_id, c.claimed_at < stale
            ).values(status="interrupted", finished_at=time.time(),
                     error="the front running this pull stopped; resume it"))
            mine = list(self._tasks)
            if not mine:
                return []
            return list(conn.execute(sa.select(c.id).where(
                c.id.in_(mine), c.status == "cancelled")).scalars())

        for job_id in await self._q(renew):
            log.info("pull %s was cancelled on another front: stopping it", job_id)
            await self._stop(job_id)

    # ---- API ------------------------------------------------------------------------------

    async def submit(self, model: str, quantize: str = "auto", init: bool = False
                     ) -> tuple[dict[str, Any], bool]:
        """The job pulling `model` (a new one, or the active one for the same reference) and
        whether it was created."""
        if quantize not in QUANTIZE:
            raise InvalidRequest(f"quantize must be one of {', '.join(QUANTIZE)}",
                                 param="quantize")
        try:
            ref = parse_ref(model)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="model") from exc
        canonical = str(ref)
        row: dict[str, Any] = {
            "id": uuid.uuid4().hex[:16], "model": model, "ref": canonical,
            "model_id": ref.model_id, "status": "queued", "quantize": quantize, "init": init,
            "created_at": time.time(), "bytes_done": 0,
            "claimed_by": self.front_id, "claimed_at": time.time(),
        }

        def find_or_insert(c: sa.Connection) -> list[dict[str, Any]]:
            if c.dialect.name == "postgresql":
                # Fronts sharing the database: the check and the insert hold a lock on the
                # reference until commit, so two fronts asked at once make one job.
                c.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext(:ref))"),
                          {"ref": "pull:" + canonical})
            existing = db.rows(c.execute(sa.select(db.jobs).where(
                db.jobs.c.ref == canonical, db.jobs.c.status.in_(ACTIVE))))
            if not existing:
                c.execute(sa.insert(db.jobs).values(**row))
            return existing

        existing = await self._q(find_or_insert)
        if existing:
            return self._view(existing[0]), False
        self._start(row["id"])
        return await self.get(row["id"]), True

    async def get(self, job_id: str) -> dict[str, Any]:
        if job_id in self._live:
            return self._view(self._live[job_id])
        found = await self._q(lambda c: db.rows(c.execute(
            sa.select(db.jobs).where(db.jobs.c.id == job_id)
        )))
        if not found:
            raise JobNotFound(job_id)
        return self._view(found[0])

    async def list(self) -> list[dict[str, Any]]:
        found = await self._q(lambda c: db.rows(c.execute(
            sa.select(db.jobs).order_by(db.jobs.c.created_at.desc())
        )))
        return [self._view(self._live.get(r["id"], r)) for r in found]

    async def cancel(self, job_id: str) -> dict[str, Any]:
        job = await self.get(job_id)
        if job["status"] not in ACTIVE:
            return job
        cancelled = {"status": "cancelled", "error": "cancelled", "error_code": "cancelled"}
        # Written first: a job another front runs is stopped there at its next heartbeat.
        await self._update(job_id, finished_at=time.time(), **cancelled)
        if job_id in self._tasks:
            await self._stop(job_id)
            # again (not counted twice): the stopped child's own last word must not stand
            await self._q(lambda c: c.execute(sa.update(db.jobs).where(
                db.jobs.c.id == job_id).values(**cancelled)))
        return await self.get(job_id)

    async def _stop(self, job_id: str) -> None:
        """Stop this front's child and task of a job (cancelled)."""
        task = self._tasks.get(job_id)
        child = self._children.get(job_id)
        if child is not None:
            await child.stop(self.settings.stop_grace_s)  # it removes its partial files
        elif task is not None:
            task.cancel()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._live.pop(job_id, None)

    async def resume(self, job_id: str) -> dict[str, Any]:
        job = await self.get(job_id)
        if job["status"] in ACTIVE:
            return job
        if job["status"] == "succeeded":
            raise InvalidRequest(f"job {job_id} already succeeded; nothing to resume")
        c = db.jobs.c
        # Conditional: of two fronts resuming one job at once, one takes it.
        taken = await self._q(lambda conn: conn.execute(
            sa.update(db.jobs).where(c.id == job_id, c.status.in_(FINAL),
                                     c.status != "succeeded")
            .values(status="queued", finished_at=None, error=None, error_code=None,
                    claimed_by=self.front_id, claimed_at=time.time())).rowcount)
        if taken:
            self._notify(job_id)
            self._start(job_id)
        return await self.get(job_id)

    async def watch(self, job_id: str) -> AsyncIterator[dict[str, Any]]:
        """The job now, then each time it changes, until it is final."""
        while True:
            event = self._changed.setdefault(job_id, asyncio.Event())
            job = await self.get(job_id)
            yield job
            if job["status"] in FINAL:
                return
            if job_id in self._tasks:
                await event.wait()
            else:  # another front runs it: its progress reaches us through the database
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), self.settings.front_sync_interval_s)

    async def wait(self, job_id: str) -> dict[str, Any]:
        """The job once it is final."""
        last: dict[str, Any] = {}
        async for job in self.watch(job_id):
            last = job
        return last

    def active(self) -> dict[str, int]:
        """Jobs queued and running now (for /metrics)."""
        running = len(self._live)
        return {"queued": max(0, len(self._tasks) - running), "running": running}

    async def shutdown(self) -> None:
        for job_id, child in list(self._children.items()):
            # Killed, not cancelled: its partial file stays for a resume after the restart.
            child.kill()
            self._children.pop(job_id, None)
        for task in list(self._tasks.values()):
            task.cancel()

    # ---- running --------------------------------------------------------------------------

    def _start(self, job_id: str) -> None:
        task = asyncio.create_task(self._run(job_id), name=f"pull:{job_id}")
        self._tasks[job_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(job_id, None))

    async def _run(self, job_id: str) -> None:
        async with self._slots:
            job = await self.get(job_id)
            if job["status"] != "queued" or not await self._claim(job_id):
                return  # cancelled meanwhile, or another front runs it
            self._live[job_id] = dict(job)
            try:
                await self._update(job_id, status="running", started_at=time.time(),
                                   bytes_done=0, error=None, error_code=None)
                final = await self._download(job_id, job)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must fail the job, not leave it running forever
                log.exception("pull %s failed", job_id)
                final = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                         "error_code": "pull_failed"}
            finally:
                self._children.pop(job_id, None)
            if final is not None:
                await self._update(job_id, finished_at=time.time(), **final)
            self._live.pop(job_id, None)
        if final is not None and final.get("status") == "succeeded":
            try:
                await self.on_pulled(await self.get(job_id))
            except ModelyardError as exc:
                log.error("pulled %s but could not load it: %s", job_id, exc.message)

    async def _claim(self, job_id: str) -> bool:
        """queued → running for this front only if it is still queued: exactly one front
        runs a job, whichever fronts try."""
        c = db.jobs.c
        now = time.time()
        taken = await self._q(lambda conn: conn.execute(
            sa.update(db.jobs).where(c.id == job_id, c.status == "queued")
            .values(status="running", started_at=now, claimed_by=self.front_id,
                    claimed_at=now)).rowcount)
        return bool(taken)

    async def _download(self, job_id: str, job: dict[str, Any]) -> dict[str, Any] | None:
        argv = [sys.executable, "-m", "modelyard.store.pull", job["ref"],
                "--quantize", job["quantize"],
                "--reserve-free-bytes", str(self.settings.reserve_free_bytes)]
        child = self._spawn(argv, name=f"pull-{job_id}",
                            log_file=self.settings.logs_dir / "pulls" / f"{job_id}.log",
                            stdout_pipe=True)
        self._children[job_id] = child
        await child.start()
        done: dict[str, Any] | None = None
        error: dict[str, Any] | None = None
        last_write = 0.0
        async for line in child.stdout_lines():
            try:
                event = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            kind = event.get("event")
            if kind == "plan":
                total = int(event.get("bytes_total") or 0)
                preferred = job["quantize"] == "q4" or (
                    job["quantize"] == "auto" and event.get("format") == "safetensors"
                    and total > Q4_THRESHOLD_BYTES
                )
                await self._update(job_id, bytes_total=total, format=event.get("format"),
                                   model_id=event.get("model_id"),
                                   preferred_quantized=preferred)
            elif kind == "file":
                await self._update(job_id, current_file=event.get("name"))
            elif kind == "progress":
                live = self._live[job_id]
                fetched = int(event.get("bytes_fetched") or 0)
                metrics.pull_fetched(fetched - live.get("bytes_fetched", 0))
                live["bytes_fetched"] = fetched
                live["bytes_done"] = int(event.get("bytes_done") or 0)
                self._notify(job_id)
                if time.monotonic() - last_write >= DB_PROGRESS_EVERY_S:
                    last_write = time.monotonic()
                    await self._update(job_id, bytes_done=live["bytes_done"])
            elif kind == "done":
                done = event
            elif kind == "error":
                error = event
        code = await child.wait()
        if error is not None and error.get("code") == "cancelled":
            return None  # cancel() writes the final state
        if done is not None and code == 0:
            await self._record_model(job, done)
            await self.catalog_changed()  # listed before the job reads succeeded
            if self.pulled_with is not None:
                await self.pulled_with({**job, "model_id": done.get("model_id") or job["model_id"],
                                        "local_path": done["local_path"]})
            total = self._live[job_id].get("bytes_total") or 0
            return {"status": "succeeded", "local_path": done["local_path"],
                    "model_id": done.get("model_id"), "bytes_done": total,
                    "current_file": None}
        if error is None:
            tail = "\n".join(child.tail(self.settings.log_tail_lines))
            error = {"code": "pull_failed", "message": f"the pull exited with {code}: {tail}"}
        message = error.get("message", "")
        if error.get("available"):
            message += f" (available: {', '.join(error['available'])})"
        return {"status": "failed", "error": message, "error_code": error.get("code")}

    async def _record_model(self, job: dict[str, Any], done: dict[str, Any]) -> None:
        row = {
            "id": done.get("model_id") or job["model_id"], "source": "pulled", "ref": job["ref"],
            "format": done.get("format", "gguf"), "path": done["local_path"],
            "mmproj": done.get("mmproj"), "files": done.get("files", []),
            "revision": done.get("revision"), "quantize": job["quantize"],
            "added_at": time.time(),
        }

        def upsert(c: sa.Connection) -> None:
            c.execute(sa.delete(db.models).where(db.models.c.id == row["id"]))
            c.execute(sa.insert(db.models).values(**row))

        await self._q(upsert)

    @staticmethod
    def _view(row: dict[str, Any]) -> dict[str, Any]:
        """A job as the API shows it."""
        keys = ("id", "model", "model_id", "status", "quantize", "init", "created_at",
                "started_at", "finished_at", "format", "local_path", "preferred_quantized",
                "bytes_done", "bytes_total", "current_file", "error", "error_code")
        out = {k: row.get(k) for k in keys}
        out["ref"] = row.get("ref")
        return out
