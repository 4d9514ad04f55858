"""The batch runner: one background task per front that runs the batches it claimed.

Each line goes through the front's own ASGI app, in process (not the dispatcher directly), so a
batch line is an ordinary request: auth's principal (the batch's owner, set in the scope and in
`CURRENT_PRINCIPAL`), usage, limits, metrics and the request log (`scope["modelyard.batch_id"]`)
all apply, and each endpoint's own handler frames the answer exactly as for a client.

Never ahead of interactive traffic, in two ways: every line is sent with priority
`BATCH_PRIORITY` (a model's queue admits higher priorities first), and a line is not even started
while its model's queue has waiters. At most `batch_max_concurrency` lines are in flight, shared
round-robin over owners and their batches; each batch drains one model at a time
(front/batches/order.py).

Memory does not grow with a batch: a running batch holds its input open and, per model, the
offsets of its lines not yet started (16 bytes a line); a line is read back when it starts and
its answer appended to the output (or error) file as it ends.

A line refused by its owner's rate limit (429) is not a failed line: the batch pauses until the
refusal's Retry-After (as long as the window needs, within the batch's completion window, after
which it expires) and the line runs again; other batches run meanwhile.

Every status change is a conditional UPDATE (BatchStore.transition): a cancel that lands while
the runner validates, runs or finalizes a batch wins, and the runner, learning it lost, ends the
batch `cancelled`.

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
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from modelyard.front.batches.files import BatchLine, FileStore, read_line, scan_batch
from modelyard.front.batches.order import next_model, next_turn
from modelyard.front.batches.store import FINAL, BatchStore
from modelyard.front.identity.principal import CURRENT_PRINCIPAL, Principal

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message

    from modelyard.front.state import FrontState

log = logging.getLogger(__name__)

BATCH_PRIORITY = -100  # X-Modelyard-Priority of every batch line: interactive (0) goes first
_BUSY = 503  # a model loading or an engine busy: retried in place, a few times
_RATE_LIMITED = 429  # the owner's limit: the batch pauses for its Retry-After
_MAX_ATTEMPTS = 6
_MAX_BACKOFF_S = 10.0
_SETTLE_ROUNDS = 5  # statuses only move forward: a few lost races at most

# A test's seam: awaited after each step the runner takes on a batch ("claimed", "in_progress",
# "finalizing"), so a test can cancel exactly there. None in production.
StepHook = Callable[[str, str], Awaitable[None]]


class _Lines:
    """One model's lines of a batch not yet started, in file order: (offset, line number)
    in two arrays, 16 bytes a line, and the few handed back to run again."""

    __slots__ = ("again", "head", "numbers", "offsets")

    def __init__(self) -> None:
        self.offsets = array("q")
        self.numbers = array("q")
        self.head = 0
        self.again: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self.offsets) - self.head + len(self.again)

    def append(self, offset: int, line_no: int) -> None:
        self.offsets.append(offset)
        self.numbers.append(line_no)

    def pop(self) -> tuple[int, int]:
        if self.again:
            return self.again.pop()
        i = self.head
        self.head += 1
        return self.offsets[i], self.numbers[i]

    def hand_back(self, item: tuple[int, int]) -> None:
        self.again.append(item)

    def __iter__(self) -> Any:
        yield from self.again
        yield from zip(self.offsets[self.head:], self.numbers[self.head:], strict=True)


@dataclass(eq=False)
class _Running:
    row: dict[str, Any]
    principal: Principal
    fd: int | None = None  # the input, open while it runs (deleting it does not stop the batch)
    pending: dict[str, _Lines] = field(default_factory=dict)  # by model
    first_line: dict[str, int] = field(default_factory=dict)  # each model's first line number
    current: str | None = None  # the model this batch drains
    in_flight: int = 0
    stopping: bool = False  # cancelled, expired or lost: no new line starts
    expired: bool = False
    paused_until: float = 0.0  # a 429's Retry-After: no line starts before

    @property
    def id(self) -> str:
        return str(self.row["id"])

    @property
    def owner(self) -> str:
        return str(self.row["owner"])


def batch_principal(row: dict[str, Any]) -> Principal:
    """The batch's owner as the auth gate would have seen them (inference scope only)."""
    user = row["owner"] or None
    return Principal(user, False, frozenset({"inference"}), "token" if user else "anonymous",
                     token_id=row["token_id"], group=row["owner_group"])


def done_ids(path: Path) -> set[int]:
    """Hashes of the custom_ids an output or error file already holds, read a line at a time;
    a torn last line (a crash in the middle of an append) is cut off so the line runs again."""
    done: set[int] = set()
    if not path.exists():
        return done
    end = 0
    with path.open("rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            end += len(raw)
            if raw.strip():
                done.add(hash(orjson.loads(raw)["custom_id"]))
    if end != path.stat().st_size:
        os.truncate(path, end)
    return done


class BatchRunner:
    def __init__(self, app: ASGIApp, state: FrontState, files: FileStore, store: BatchStore,
                 *, max_concurrency: int, lease_s: float,
                 clock: Callable[[], float] = time.time, after_step: StepHook | None = None
                 ) -> None:
        self.app = app
        self.state = state
        self.files = files
        self.store = store
        self.max_concurrency = max_concurrency
        self.lease_s = lease_s
        self.clock = clock  # a 429's pause and the completion window (tests move it)
        self.after_step = after_step
        self.front_id = "front-" + secrets.token_hex(8)
        self.running: dict[str, _Running] = {}
        self.in_flight: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._claim_now = True
        self._task: asyncio.Task[None] | None = None
        self._turns = 0
        self._owner_served: dict[str, int] = {}
        self._batch_served: dict[str, int] = {}

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batch-runner")

    def wake(self) -> None:
        """A batch was created or cancelled: claim and read statuses now, not at the tick."""
        self._claim_now = True
        self._wake.set()

    def cancelled(self, batch_id: str) -> None:
        """A batch was cancelled through this front: if this runner holds it, it starts no
        other line from now on (the tick that reads statuses may be a database round away,
        and a line freed meanwhile would start one), then the loop ends it."""
        run = self.running.get(batch_id)
        if run is not None:
            run.stopping = True
        self.wake()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self.in_flight):
            task.cancel()
        await asyncio.gather(*self.in_flight, return_exceptions=True)
        for run in self.running.values():
            _close(run)
        await asyncio.to_thread(self.store.release, self.front_id)

    # ---- the loop -------------------------------------------------------------------------

    async def _loop(self) -> None:
        tick = self.lease_s / 3
        next_claim = 0.0
        while True:
            self._wake.clear()  # before the work: a wake during it runs the loop again
            try:
                if self._claim_now or time.monotonic() >= next_claim:
                    self._claim_now = False
                    await self._claim_and_renew()
                    next_claim = time.monotonic() + tick
                await self._schedule()
                await self._finish_done()
            except asyncio.CancelledError:
                raise
            except Exception:  # a database hiccup: log it, try again on the next tick
                log.exception("batch runner")
            with contextlib.suppress(TimeoutError):
                # Lines blocked by interactive waiters or paused by a 429 are retried soon.
                await asyncio.wait_for(self._wake.wait(), 0.5 if self._pending() else tick)

    def _pending(self) -> bool:
        return any(any(r.pending.values()) for r in self.running.values() if not r.stopping)

    async def _step(self, batch_id: str, step: str) -> None:
        if self.after_step is not None:
            await self.after_step(batch_id, step)

    async def _claim_and_renew(self) -> None:
        held = await asyncio.to_thread(self.store.renew, self.front_id, list(self.running),
                                       self.lease_s)
        for lost in set(self.running) - held:  # another front took it (our lease ran out)
            self.running[lost].stopping = True
        for row in await asyncio.to_thread(self.store.claim, self.front_id, self.lease_s):
            if row["id"] not in self.running:
                await self._take_up(row)
        statuses = await asyncio.to_thread(self.store.statuses, list(self.running))
        now = self.clock()
        for batch_id, run in self.running.items():
            if statuses.get(batch_id) == "cancelling":
                run.stopping = True
            elif now > run.row["expires_at"] and not run.stopping:
                run.stopping = run.expired = True

    async def _take_up(self, row: dict[str, Any]) -> None:
        """Index a claimed batch's lines, less those a previous run finished, and move it to
        in_progress unless a cancel came first."""
        batch_id = row["id"]
        run = _Running(row, batch_principal(row))
        self.running[batch_id] = run
        await self._step(batch_id, "claimed")
        if row["status"] == "cancelling":
            run.stopping = True
            return
        try:
            ok, failed = await asyncio.to_thread(self._index, run)
        except Exception as exc:  # the input vanished or went bad: the batch fails
            log.warning("batch %s cannot run: %s", batch_id, exc)
            _close(run)
            run.pending.clear()
            if await asyncio.to_thread(
                    self.store.transition, batch_id, ("validating", "in_progress"), "failed",
                    holder=self.front_id, failed_at=time.time(), claimed_by=None,
                    lease_until=None, errors={"object": "list", "data": [{
                        "code": "invalid_batch_file", "line": None, "message": str(exc),
                        "param": None}]}):
                del self.running[batch_id]
            else:  # cancelled meanwhile: it ends cancelled, not failed
                run.stopping = True
            return
        # The files are the record; the counters follow them. A front stopped between a
        # line's append and its count would otherwise leave the batch one short for ever.
        if (ok, failed) != (row["completed"], row["failed"]):
            await asyncio.to_thread(self.store.update, batch_id, completed=ok, failed=failed)
        if row["status"] == "validating":
            if await asyncio.to_thread(
                    self.store.transition, batch_id, ("validating",), "in_progress",
                    holder=self.front_id, in_progress_at=time.time()):
                await self._step(batch_id, "in_progress")
            else:  # a cancel won (or another front): this runner starts nothing of it
                run.stopping = True
        log.info("batch %s: %d line(s) to run", batch_id,
                 sum(len(q) for q in run.pending.values()))

    def _index(self, run: _Running) -> tuple[int, int]:
        """Blocking: open the input and note where each line not yet finished starts, by
        model; returns how many lines the output and error files already hold."""
        row = run.row
        finished = {file_id: done_ids(self.files.path(file_id))
                    for file_id in (row["output_file_id"], row["error_file_id"]) if file_id}
        done = set().union(*finished.values())
        run.fd = os.open(self.files.path(row["input_file_id"]), os.O_RDONLY)
        with os.fdopen(os.dup(run.fd), "rb") as f:
            for entry in scan_batch(f, row["endpoint"]):
                if hash(entry.custom_id) in done:
                    continue
                run.pending.setdefault(entry.model, _Lines()).append(entry.offset,
                                                                      entry.line_no)
                run.first_line.setdefault(entry.model, entry.line_no)
        return (len(finished.get(row["output_file_id"], ())),
                len(finished.get(row["error_file_id"], ())))

    async def _schedule(self) -> None:
        if len(self.in_flight) >= self.max_concurrency or not self._pending():
            return  # nothing to start: no need to know what is loaded
        loaded = await self._loaded_models()
        queues = self.state.dispatch.queues
        while len(self.in_flight) < self.max_concurrency:
            now = self.clock()
            turns: list[tuple[_Running, str]] = []
            for run in self.running.values():
                if run.stopping or run.paused_until > now:
                    continue
                counts = {m: len(q) for m, q in run.pending.items() if q}
                model = next_model(counts, loaded=loaded, current=run.current,
                                   first_line=run.first_line,
                                   blocked={m for m in counts if queues.queued(m) > 0})
                if model is not None:
                    turns.append((run, model))
            if not turns:
                return
            run, model = turns[next_turn([(r.owner, r.id) for r, _ in turns],
                                         self._owner_served, self._batch_served)]
            self._turns += 1
            self._owner_served[run.owner] = self._batch_served[run.id] = self._turns
            run.current = model
            place = run.pending[model].pop()
            run.in_flight += 1
            task = asyncio.create_task(self._run_line(run, model, place),
                                       name=f"batch-line-{model}")
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
        """Batches with nothing left to run or in flight: settle them."""
        for batch_id, run in list(self.running.items()):
            left = any(run.pending.values()) and not run.stopping
            if left or run.in_flight:
                continue
            del self.running[batch_id]
            self._batch_served.pop(batch_id, None)
            if not any(r.owner == run.owner for r in self.running.values()):
                self._owner_served.pop(run.owner, None)
            try:
                await self._settle(run)
            finally:
                _close(run)

    async def _settle(self, run: _Running) -> None:
        """Write how the batch ended, each status change conditional on the one read: a cancel
        landing at any step (finalizing included) wins, and the batch ends `cancelled`."""
        batch_id = run.id
        if run.expired:  # lines never started go to the error file, as OpenAI does
            await asyncio.to_thread(self._expire_pending, run)
        error_file = await asyncio.to_thread(self._tidy_files, run)
        for _ in range(_SETTLE_ROUNDS):
            current = await asyncio.to_thread(self.store.get, batch_id)
            status = current["status"]
            if current["claimed_by"] != self.front_id or status in FINAL:
                return  # another front holds it now, or it already ended
            now = time.time()
            if status == "cancelling":
                final: dict[str, Any] = {"status": "cancelled", "cancelled_at": now}
            elif run.expired:
                final = {"status": "expired", "expired_at": now}
            elif status == "finalizing":
                final = {"status": "completed", "completed_at": now}
            else:  # in_progress (or validating): finalizing first, then completed
                if await asyncio.to_thread(self.store.transition, batch_id, (status,),
                                           "finalizing", holder=self.front_id,
                                           finalizing_at=now):
                    await self._step(batch_id, "finalizing")
                continue
            if await asyncio.to_thread(
                    self.store.transition, batch_id, (status,), final.pop("status"),
                    holder=self.front_id, error_file_id=error_file, claimed_by=None,
                    lease_until=None, **final):
                log.info("batch %s ended (%s)", batch_id, status)
                return
        log.warning("batch %s: its status kept changing; left for the next claim", batch_id)

    def _expire_pending(self, run: _Running) -> None:
        assert run.fd is not None or not any(run.pending.values())
        for queue in run.pending.values():
            for offset, line_no in queue:
                line = read_line(run.fd, offset, line_no)  # type: ignore[arg-type]
                self._append(run.row["error_file_id"], _error_line(
                    line, "batch_expired", "the batch expired before this line ran"))
                self.store.count(run.id, ok=False)
        run.pending.clear()

    def _tidy_files(self, run: _Running) -> str | None:
        """An empty error file goes (OpenAI leaves it null); the sizes are recorded."""
        row = run.row
        error_file: str | None = row["error_file_id"]
        if error_file and self.files.path(error_file).stat().st_size == 0:
            self.files.delete_unchecked(error_file)
            error_file = None
        for file_id in (row["output_file_id"], error_file):
            if file_id:
                self.files.sync_size(file_id)
        return error_file

    # ---- one line -------------------------------------------------------------------------

    async def _run_line(self, run: _Running, model: str, place: tuple[int, int]) -> None:
        batch_id = run.id
        try:
            assert run.fd is not None
            line = await asyncio.to_thread(read_line, run.fd, *place)
            status, headers, body = await self._send(run, line)
            if status == _RATE_LIMITED:  # the owner's limit: pause the batch, not fail it
                run.paused_until = self.clock() + _retry_after(headers)
                run.pending[model].hand_back(place)
                return
            ok = 200 <= status < 300
            out = {"id": "batch_req_" + secrets.token_hex(12), "custom_id": line.custom_id,
                   "response": {"status_code": status, "request_id": headers.get("x-request-id"),
                                "body": _json_or_text(body)},
                   "error": None if ok else _error_of(body)}
            file_id = run.row["output_file_id"] if ok else run.row["error_file_id"]
            await asyncio.to_thread(self._append, file_id, out)
            await asyncio.to_thread(self.store.count, batch_id, ok=ok)
        except Exception:
            log.exception("batch %s line %d", batch_id, place[1])
            run.pending[model].hand_back(place)  # run it again
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

    async def _send(self, run: _Running, line: BatchLine
                    ) -> tuple[int, dict[str, str], bytes]:
        """POST the line through the front's app, as its owner, at batch priority; a busy
        server (503: a model loading) is retried after its Retry-After (at most
        `_MAX_BACKOFF_S`), a few times. A 429 goes back to the caller, which pauses the
        batch for as long as the limit says."""
        for attempt in range(1, _MAX_ATTEMPTS + 1):
            status, headers, body = await self._call_app(run, line)
            if status != _BUSY or attempt == _MAX_ATTEMPTS:
                return status, headers, body
            await asyncio.sleep(min(_MAX_BACKOFF_S, _retry_after(headers)))
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


def _close(run: _Running) -> None:
    if run.fd is not None:
        os.close(run.fd)
        run.fd = None


def _retry_after(headers: dict[str, str]) -> float:
    wait = headers.get("retry-after", "1")
    return float(wait) if wait.isdigit() else 1.0


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
