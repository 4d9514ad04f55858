"""The batch runner (front/batches/runner.py) on a real SQLite file and real files, against a tiny
ASGI app standing in for the front's routes.

A batch taken up again trusts its output and error files, not its counters: the runner appends
a finished line to the output file, then counts it in the database; a front stopped between the
two (it happened in CI) left a resumed batch "completed" one line short.

An idle runner asks the engines nothing: it polled every engine's /status each tick even with no
batch, which also broke the "a cold route makes no /status call" test when a tick fell inside it.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from modelyard import db
from modelyard.front.batches.files import FileStore, new_id
from modelyard.front.batches.runner import BatchRunner
from modelyard.front.batches.store import BatchStore
from modelyard.front.identity.principal import Principal

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]

ALICE = Principal("alice", False, frozenset({"inference"}), "token")


class Answers:
    """The ASGI app: every POST is a chat completion answered at once."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = orjson.loads((await receive())["body"])
        self.asked.append(body["messages"][0]["content"])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": orjson.dumps(
            {"object": "chat.completion", "choices": [{"message": {"content": "ok"}}]})})


def _line(custom_id: str) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST",
                         "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": [{"role": "user",
                                                              "content": custom_id}]}})


def _three_line_batch(tmp_path: Path) -> tuple[Any, FileStore, BatchStore, dict[str, Any]]:
    """A database, its file and batch stores, and alice's batch of lines "a", "b", "c"."""
    database = db.connect(f"sqlite:///{tmp_path / 'modelyard.db'}")
    files = FileStore(database, tmp_path / "files", 1 << 20)
    store = BatchStore(database)
    source = files.save("alice", "batch", "in.jsonl",
                        io.BytesIO(b"\n".join(_line(c) for c in ("a", "b", "c")) + b"\n"))
    output, errors = new_id("file"), new_id("file")
    files.new_output(output, "alice", "out.jsonl")
    files.new_output(errors, "alice", "err.jsonl")
    batch = store.create(ALICE, endpoint="/v1/chat/completions", input_file_id=source["id"],
                         window="24h", meta=None, total=3, output_file_id=output,
                         error_file_id=errors)
    return database, files, store, batch


async def test_a_line_written_but_not_counted_is_counted_when_the_batch_resumes(
    tmp_path: Path,
) -> None:
    database, files, store, batch = _three_line_batch(tmp_path)
    output = batch["output_file_id"]
    store.update(batch["id"], status="in_progress")
    # What a front stopped after line "a"'s append and before its count left behind.
    files.path(output).write_bytes(orjson.dumps(
        {"id": "batch_req_1", "custom_id": "a", "response": {"status_code": 200},
         "error": None}) + b"\n")

    app = Answers()
    state = SimpleNamespace(dispatch=SimpleNamespace(
        queues=SimpleNamespace(queued=lambda model: 0), loaded_models=_nothing_loaded))
    runner = BatchRunner(app, state, files, store,  # type: ignore[arg-type]
                         max_concurrency=2, lease_s=30.0)
    runner.start()
    try:
        async with asyncio.timeout(15):
            while store.get(batch["id"])["status"] != "completed":
                runner.wake()
                await asyncio.sleep(0.02)
    finally:
        await runner.close()
        database.dispose()

    done = store.get(batch["id"])
    assert (done["total"], done["completed"], done["failed"]) == (3, 3, 0)
    assert sorted(app.asked) == ["b", "c"]  # "a" was not run again
    out = [orjson.loads(x)["custom_id"] for x in files.path(output).read_bytes().splitlines()]
    assert sorted(out) == ["a", "b", "c"]


async def _nothing_loaded() -> set[str]:
    return set()


class Dispatch:
    """Counts what the runner asks the dispatcher."""

    def __init__(self) -> None:
        self.asked = 0
        self.queues = SimpleNamespace(queued=lambda model: 0)

    async def loaded_models(self) -> set[str]:
        self.asked += 1
        return set()

    running_models = loaded_models


async def test_an_idle_runner_asks_the_engines_nothing(tmp_path: Path) -> None:
    database = db.connect(f"sqlite:///{tmp_path / 'modelyard.db'}")
    dispatch = Dispatch()
    runner = BatchRunner(Answers(), SimpleNamespace(dispatch=dispatch),  # type: ignore[arg-type]
                         FileStore(database, tmp_path / "files", 1 << 20), BatchStore(database),
                         max_concurrency=2, lease_s=30.0)
    try:
        for _ in range(3):  # what each tick of the loop does, with no batch
            await runner._claim_and_renew()
            await runner._schedule()
            await runner._finish_done()
        assert dispatch.asked == 0
    finally:
        await runner.close()
        database.dispose()


# ---- a cancel at each step wins (issue 31, item 3) -------------------------------------------
# The runner's `after_step` seam is awaited right after it takes a step on a batch; cancelling
# there is the race that lost cancels (the runner read `validating`, a cancel landed, the runner
# wrote `in_progress` over it), made deterministic.

class Held(Answers):
    """The app holds every line until `go` is set; `arrived` says one is in."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived = asyncio.Event()
        self.go = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.arrived.set()
        await self.go.wait()
        await super().__call__(scope, receive, send)


@pytest.mark.parametrize("step", ["claimed", "in_progress", "line_in_flight", "finalizing"])
async def test_a_cancel_at_any_step_ends_the_batch_cancelled(tmp_path: Path, step: str) -> None:
    database, files, store, batch = _three_line_batch(tmp_path)
    seen: list[str] = []

    async def cancel_at(batch_id: str, at: str) -> None:
        seen.append(at)
        if at == step:
            assert store.cancel(batch_id, ALICE)["status"] == "cancelling"

    app = Held() if step == "line_in_flight" else Answers()
    state = SimpleNamespace(dispatch=SimpleNamespace(
        queues=SimpleNamespace(queued=lambda model: 0), loaded_models=_nothing_loaded))
    runner = BatchRunner(app, state, files, store,  # type: ignore[arg-type]
                         max_concurrency=1, lease_s=30.0, after_step=cancel_at)
    runner.start()
    try:
        async with asyncio.timeout(15):
            if isinstance(app, Held):
                await app.arrived.wait()
                store.cancel(batch["id"], ALICE)
                runner.cancelled(batch["id"])  # what POST /v1/batches/{id}/cancel does
                app.go.set()
            while store.get(batch["id"])["status"] not in ("completed", "cancelled",
                                                           "failed", "expired"):
                await asyncio.sleep(0.02)
    finally:
        await runner.close()
        database.dispose()
    done = store.get(batch["id"])
    assert done["status"] == "cancelled", (step, seen, done["status"])
    assert done["cancelled_at"] is not None
    if step == "claimed":  # cancelled before it was in progress: no line ever started
        assert app.asked == []
    if step == "line_in_flight":  # the line in flight finished and was kept; no other began
        assert app.asked == ["a"]
        assert done["completed"] == 1
