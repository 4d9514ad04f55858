"""The batch runner: one background task per front that runs the batches it claimed.

Each line goes through the front's own ASGI app, in process (not the dispatcher directly), so a
batch line is an ordinary request: auth's principal (the batch's owner, set in the scope and in
`CURRENT_PRINCIPAL`), usage, limits, metrics and the request log (`scope["modelyard.batch_id"]`)
all apply, and each endpoint's own handler frames the answer exactly as for a client.

Never ahead of interactive traffic, in two ways: every line is sent with priority
`BATCH_PRIORITY` (a model's queue admits higher priorities first), and a line is not even started
while its model's queue has waiters. At most `batch_max_concurrency` lines are in flight. Lines
are grouped by model across every running batch (front/batches/order.py).

Progress survives a restart: a finished line is appended to the output (or error) file as it
ends, and a batch taken up again (by this front restarted, or by another after the claim's lease
ran out) skips the custom_ids those files already hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from modelyard.front.batches.files import BatchLine, FileStore
from modelyard.front.batches.order import next_model
from modelyard.front.batches.store import BatchStore
from modelyard.front.identity.principal import CURRENT_PRINCIPAL, Principal

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message

    from modelyard.front.state import FrontState

log = logging.getLogger(__name__)

BATCH_PRIORITY = -100  # X-Modelyard-Priority of every batch line: interactive (0) goes first
_RETRY_STATUSES = (429, 503)  # the server is busy or a model is loading: try the line again
_MAX_ATTEMPTS = 6
_MAX_BACKOFF_S = 10.0


@dataclass(eq=False)
class _Running:
    row: dict[str, Any]
    principal: Principal
    pending: dict[str, deque[BatchLine]] = field(default_factory=dict)  # by model
    in_flight: int = 0
    stopping: bool = False  # cancelled or expired: no new line starts


def batch_principal(row: dict[str, Any]) -> Principal:
    """The batch's owner as the auth gate would have seen them (inference scope only)."""
    user = row["owner"] or None
    return Principal(user, False, frozenset({"inference"}), "token" if user else "anonymous",
                     token_id=row["token_id"], group=row["owner_group"])


def done_ids(path: Path) -> set[str]:
    """custom_ids an output or error file already holds; a torn last line (a crash in the
    middle of an append) is cut off so the line runs again."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        os.truncate(path, end)
    return {orjson.loads(line)["custom_id"] for line in data[:end].splitlines() if line.strip()}


class BatchRunner:
    def __init__(self, app: ASGIApp, state: FrontState, files: FileStore, store: BatchStore,
                 *, max_concurrency: int, lease_s: float) -> None:
        self.app = app
        self.state = state
        self.files = files
        self.store = store
        self.max_concurrency = max_concurrency
        self.lease_s = lease_s
        self.front_id = "front-" + secrets.token_hex(8)
        self.running: dict[str, _Running] = {}
        self.in_flight: set[asyncio.Task[None]] = set()
        self.current: str | None = None  # the model being drained
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._seq = 0
        self._first_line: dict[str, int] = {}

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batch-runner")

    def wake(self) -> None:
        self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self.in_flight):
            task.cancel()
        await asyncio.gather(*self.in_flight, return_exceptions=True)
        await asyncio.to_thread(self.store.release, self.front_id)

    # ---- the loop -------------------------------------------------------------------------

    async def _loop(self) -> None:
        tick = self.lease_s / 3
        next_claim = 0.0
        while True:
            try:
                if time.monotonic() >= next_claim:
                    await self._claim_and_renew()
                    next_claim = time.monotonic() + tick
                await self._schedule()
                await self._finish_done()
            except asyncio.CancelledError:
                raise
            except Exception:  # a database hiccup: log it, try again on the next tick
                log.exception("batch runner")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                # Lines blocked by interactive waiters are retried soon, not at the next claim.
                await asyncio.wait_for(self._wake.wait(), 0.5 if self._pending() else tick)

    def _pending(self) -> bool:
        return any(any(q for q in r.pending.values()) for r in self.running.values()
                   if not r.stopping)

    async def _claim_and_renew(self) -> None:
        held = await asyncio.to_thread(self.store.renew, self.front_id, list(self.running),
                                       self.lease_s)
        for lost in set(self.running) - held:  # another front took it (our lease ran out)
            self.running[lost].stopping = True
        for row in await asyncio.to_thread(self.store.claim, self.front_id, self.lease_s):
            if row["id"] not in self.running:
                await self._take_up(row)
        statuses = await asyncio.to_thread(self.store.statuses, list(self.running))
        now = time.time()
        for batch_id, run in self.running.items():
            if statuses.get(batch_id) == "cancelling":
                run.stopping = True
            elif now > run.row["expires_at"] and not run.stopping:
                run.stopping = True
                run.row["expire"] = True

    async def _take_up(self, row: dict[str, Any]) -> None:
        """Load a claimed batch's lines, less those a previous run finished."""
        batch_id = row["id"]
        run = _Running(row, batch_principal(row))
        self.running[batch_id] = run
        if row["status"] == "cancelling":
            run.stopping = True
            return
        try:
            lines = await asyncio.to_thread(self.files.read_batch, row["input_file_id"],
                                            row["endpoint"])
            finished = {file_id: await asyncio.to_thread(done_ids, self.files.path(file_id))
                        for file_id in (row["output_file_id"], row["error_file_id"]) if file_id}
        except Exception as exc:  # the input vanished or went bad: the batch fails
            log.warning("batch %s cannot run: %s", batch_id, exc)
            del self.running[batch_id]
            await asyncio.to_thread(self.store.update, batch_id, status="failed",
                                    failed_at=time.time(), claimed_by=None, errors={
                                        "object": "list", "data": [{
                                            "code": "invalid_batch_file", "line": None,
                                            "message": str(exc), "param": None}]})
            return
        # The files are the record; the counters follow them. A front stopped between a
        # line's append and its count would otherwise leave the batch one short for ever.
        ok = len(finished.get(row["output_file_id"], ()))
        failed = len(finished.get(row["error_file_id"], ()))
        if (ok, failed) != (row["completed"], row["failed"]):
            await asyncio.to_thread(self.store.update, batch_id, completed=ok, failed=failed)
        done = set().union(*finished.values())
        for line in lines:
            if line.custom_id in done:
                continue
            run.pending.setdefault(line.model, deque()).append(line)
            self._first_line.setdefault(line.model, self._seq)
            self._seq += 1
        if row["status"] == "validating":
            await asyncio.to_thread(self.store.update, batch_id, status="in_progress",
                                    in_progress_at=time.time())
        log.info("batch %s: %d line(s) to run", batch_id,
                 sum(len(q) for q in run.pending.values()))

    async def _schedule(self) -> None:
        if len(self.in_flight) >= self.max_concurrency or not self._pending():
            return  # nothing to start: no need to know what is loaded
        loaded = await self._loaded_models()
        while len(self.in_flight) < self.max_concurrency:
            pending: dict[str, int] = defaultdict(int)
            for active in self.running.values():
                if not active.stopping:
                    for name, queue in active.pending.items():
                        pending[name] += len(queue)
            blocked = {m for m in pending if self.state.dispatch.queues.queued(m) > 0}
            model = next_model(pending, loaded=loaded, current=self.current,
                               first_line=self._first_line, blocked=blocked)
            if model is None:
                return
            self.current = model
            run = next(r for r in self.running.values()
                       if not r.stopping and r.pending.get(model))
            line = run.pending[model].popleft()
            run.in_flight += 1
            task = asyncio.create_task(self._run_line(run, line), name=f"batch-line-{model}")
            self.in_flight.add(task)
            task.add_done_callback(self._line_done)

    def _line_done(self, task: asyncio.Task[None]) -> None:
        self.in_flight.discard(task)
        self._wake.set()

    async def _loaded_models(self) -> set[str]:
        try:
            return await self.state.dispatch.loaded_models()
        except Exception:
            return set()

    async def _finish_done(self) -> None:
        """Batches with nothing left to run or in flight: finalize them."""
        for batch_id, run in list(self.running.items()):
            left = any(run.pending.values()) and not run.stopping
            if left or run.in_flight:
                continue
            del self.running[batch_id]
            await asyncio.to_thread(self._finalize, run)

    def _finalize(self, run: _Running) -> None:
        row, now = run.row, time.time()
        batch_id = row["id"]
        current = self.store.get(batch_id)
        if current["claimed_by"] != self.front_id:
            return  # another front holds it now
        if row.get("expire"):  # lines never started go to the error file, as OpenAI does
            for queue in run.pending.values():
                for line in queue:
                    self._append(row["error_file_id"], _error_line(
                        line, "batch_expired", "the batch expired before this line ran"))
                    self.store.count(batch_id, ok=False)
        error_file: str | None = row["error_file_id"]
        if error_file and self.files.path(error_file).stat().st_size == 0:
            self.files.delete_unchecked(error_file)
            error_file = None
        for file_id in (row["output_file_id"], error_file):
            if file_id:
                self.files.sync_size(file_id)
        if current["status"] == "cancelling":
            final = {"status": "cancelled", "cancelled_at": now}
        elif row.get("expire"):
            final = {"status": "expired", "expired_at": now}
        else:
            final = {"status": "completed", "completed_at": now}
        self.store.update(batch_id, finalizing_at=now, error_file_id=error_file,
                          claimed_by=None, lease_until=None, **final)
        log.info("batch %s %s", batch_id, final["status"])

    # ---- one line -------------------------------------------------------------------------

    async def _run_line(self, run: _Running, line: BatchLine) -> None:
        batch_id = run.row["id"]
        try:
            status, request_id, body = await self._send(run, line)
            ok = 200 <= status < 300
            out = {"id": "batch_req_" + secrets.token_hex(12), "custom_id": line.custom_id,
                   "response": {"status_code": status, "request_id": request_id,
                                "body": _json_or_text(body)},
                   "error": None if ok else _error_of(body)}
            file_id = run.row["output_file_id"] if ok else run.row["error_file_id"]
            await asyncio.to_thread(self._append, file_id, out)
            await asyncio.to_thread(self.store.count, batch_id, ok=ok)
        except Exception:
            log.exception("batch %s line %d", batch_id, line.line_no)
            run.pending.setdefault(line.model, deque()).appendleft(line)  # run it again
        finally:
            run.in_flight -= 1

    def _append(self, file_id: str, out: dict[str, Any]) -> None:
        """One write of a whole line in append mode: a crash leaves at most a torn last line
        (`done_ids` cuts it)."""
        fd = os.open(self.files.path(file_id), os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, orjson.dumps(out) + b"\n")
        finally:
            os.close(fd)

    async def _send(self, run: _Running, line: BatchLine) -> tuple[int, str | None, bytes]:
        """POST the line through the front's app, as its owner, at batch priority; a busy
        server (429, 503) is retried after its Retry-After (at most `_MAX_BACKOFF_S`)."""
        for attempt in range(1, _MAX_ATTEMPTS + 1):
            status, headers, body = await self._call_app(run, line)
            if status not in _RETRY_STATUSES or attempt == _MAX_ATTEMPTS:
                return status, headers.get("x-request-id"), body
            wait = headers.get("retry-after", "1")
            await asyncio.sleep(min(_MAX_BACKOFF_S, float(wait) if wait.isdigit() else 1.0))
        raise AssertionError("unreachable")

    async def _call_app(self, run: _Running, line: BatchLine
                        ) -> tuple[int, dict[str, str], bytes]:
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": line.url, "raw_path": line.url.encode(),
            "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(line.body)).encode()),
                        (b"x-modelyard-priority", str(BATCH_PRIORITY).encode()),
                        (b"host", b"127.0.0.1")],
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
            "modelyard.batch_id": run.row["id"], "modelyard.batch_principal": run.principal,
        }
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": line.body, "more_body": False}
            await asyncio.Event().wait()  # no disconnect: the runner waits for the answer
            raise AssertionError("unreachable")

        status = 500
        headers: dict[str, str] = {}
        chunks: list[bytes] = []

        async def send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers.update((k.decode("latin-1").lower(), v.decode("latin-1"))
                               for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        token = CURRENT_PRINCIPAL.set(run.principal)
        try:
            await self.app(scope, receive, send)
        finally:
            CURRENT_PRINCIPAL.reset(token)
        return status, headers, b"".join(chunks)


def _json_or_text(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace")


def _error_of(body: bytes) -> dict[str, Any]:
    data = _json_or_text(body)
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return {"code": err.get("code"), "message": err.get("message")}
    return {"code": "request_failed", "message": str(err if err is not None else data)[:500]}


def _error_line(line: BatchLine, code: str, message: str) -> dict[str, Any]:
    return {"id": "batch_req_" + secrets.token_hex(12), "custom_id": line.custom_id,
            "response": None, "error": {"code": code, "message": message}}
