"""Live logs (front/ops/logs.py, front/api/logs.py): line parsing, redaction, reading files by seq,
following them through rotation and truncation, the in-memory ring, rotation on start, and the
routes' source resolution over a stub front."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from modelyard.config import Settings
from modelyard.engine.backends.openai_server import log_path
from modelyard.errors import ModelyardError
from modelyard.front.api import logs as logs_api
from modelyard.front.dispatch.dispatcher import EngineModel
from modelyard.front.ops.logs import FRONT, BufferLog, LogBuffer
from modelyard.front.render import render_error
from modelyard.proc.logfile import FileLog, parse_line
from modelyard.proc.process import rotate_log
from modelyard.store.registry import ModelRegistry
from modelyard.wire.logs import LogLine, redact
from modelyard.wire.status import ModelStatus

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]


# ---- lines and redaction -----------------------------------------------------------------------


def test_our_format_gives_time_and_level() -> None:
    line = parse_line("2024-05-01 12:30:45,250 WARNING modelyard.engine: cooling\n", 7, "engine-0")
    expected_ts = time.mktime(time.strptime("2024-05-01 12:30:45", "%Y-%m-%d %H:%M:%S")) + 0.25
    assert line == LogLine(7, "engine-0", "modelyard.engine: cooling", expected_ts, "warning")


def test_uvicorn_and_foreign_lines() -> None:
    assert parse_line("ERROR:    boom", 1, "e").level == "error"
    assert parse_line("ERROR:    boom", 1, "e").text == "boom"
    raw = parse_line("srv  update_slots: all slots are idle\r\n", 3, "m")
    assert (raw.text, raw.level, raw.ts) == ("srv  update_slots: all slots are idle", None, None)


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("Authorization: Bearer my-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789_-abcdefg", "my-AbCd"),
        ("headers={'authorization': 'Bearer sometoken.value'}", "sometoken"),
        ("Authorization: Basic dXNlcjpwYXNz", "dXNlcjpwYXNz"),
        ('{"authorization": "rawkey123"}', "rawkey123"),
        ("token my-0123456789abcdefghijklmnopqrstuvwxyzABCDEFG leaked", "my-0123"),
        ("key sk-proj-0123456789abcdefghijklmn used", "sk-proj-0123"),
        ("HF_TOKEN hf_abcdefghijklmnopqrstuvwxyz012345", "hf_abcdefgh"),
        ('{"username": "admin", "password": "hunter2 two"}', "hunter2"),
        ("login password=s3cret&user=x", "s3cret"),
        ("api_key: abc123", "abc123"),
    ],
)
def test_secrets_are_redacted(text: str, secret: str) -> None:
    out = redact(text)
    assert secret not in out
    assert "[redacted]" in out


def test_ordinary_lines_are_not_redacted() -> None:
    for text in ("print_info: BOS token        = 1 '<|im_start|>'", "n_tokens = 12, basic setup",
                 "slot update: prompt tokens 4"):
        assert redact(text) == text


# ---- reading files -----------------------------------------------------------------------------


def _write(path: Path, *lines: str, end: str = "\n") -> None:
    with path.open("a") as f:
        f.write("".join(line + end for line in lines))


def texts(lines: list[LogLine]) -> list[str]:
    return [line.text for line in lines]


def test_file_tail_after_and_next(tmp_path: Path) -> None:
    path = tmp_path / "m.log"
    log = FileLog(path, "m")
    assert log.read(None, 10) == ([], 0)  # not written yet
    _write(path, *(f"line {i}" for i in range(10)))
    lines, cursor = log.read(None, 3)
    assert texts(lines) == ["line 7", "line 8", "line 9"]
    assert cursor == path.stat().st_size == lines[-1].seq
    assert all(line.source == "m" for line in lines)
    # seq is the offset just past a line: `after=seq` goes on with the next one
    everything, _ = log.read(0, 100)
    assert texts(everything) == [f"line {i}" for i in range(10)]
    after_third, cursor = log.read(everything[2].seq, 2)
    assert texts(after_third) == ["line 3", "line 4"]
    assert cursor == after_third[-1].seq
    assert texts(log.read(cursor, 100)[0]) == [f"line {i}" for i in range(5, 10)]
    # an `after` in the middle of a line starts at the next whole line
    assert texts(log.read(everything[2].seq + 2, 1)[0]) == ["line 4"]
    # an `after` past the end: the file was rotated or truncated since, read it from the start
    assert texts(log.read(10**9, 2)[0]) == ["line 0", "line 1"]
    assert log.read(path.stat().st_size, 10) == ([], path.stat().st_size)


def test_a_line_being_written_waits_for_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "m.log"
    _write(path, "done")
    _write(path, "loading....", end="")
    lines, cursor = FileLog(path, "m").read(None, 10)
    assert texts(lines) == ["done"] and cursor == len("done\n")
    assert FileLog(path, "m").read(cursor, 10) == ([], cursor)
    _write(path, " ok")
    assert texts(FileLog(path, "m").read(cursor, 10)[0]) == ["loading.... ok"]


def test_tail_of_a_big_file_reads_only_its_end(tmp_path: Path) -> None:
    path = tmp_path / "big.log"
    _write(path, *(f"{i:08d} " + "x" * 100 for i in range(20000)))  # ~2 MB
    lines, cursor = FileLog(path, "big").read(None, 5)
    assert [t[:8] for t in texts(lines)] == [f"{i:08d}" for i in range(19995, 20000)]
    assert cursor == path.stat().st_size
    forward, _ = FileLog(path, "big").read(0, 5000)
    assert len(forward) == 5000 and forward[-1].text.startswith("00004999")


def test_parsed_lines_of_our_own_format(tmp_path: Path) -> None:
    path = tmp_path / "engine-0.log"
    _write(path, "2024-05-01 12:30:45,250 INFO modelyard.engine: loading m (10 MiB reserved)",
           "Traceback (most recent call last):")
    lines, _ = FileLog(path, "engine-0").read(None, 10)
    assert [(x.level, x.ts is not None) for x in lines] == [("info", True), (None, False)]


# ---- following files ---------------------------------------------------------------------------


async def next_lines(follower: AsyncGenerator[list[LogLine], None], want: int) -> list[str]:
    """The next `want` lines the follower delivers (empty batches are its idle ticks)."""
    got: list[str] = []

    async def collect() -> None:
        async for batch in follower:
            got.extend(texts(batch))
            if len(got) >= want:
                return

    await asyncio.wait_for(collect(), 5)
    return got


async def test_follow_sees_new_lines_rotation_and_truncation(tmp_path: Path) -> None:
    path = tmp_path / "m.log"
    log = FileLog(path, "m")
    follower = log.follow(0, poll_s=0.01)
    try:
        assert await asyncio.wait_for(follower.__anext__(), 5) == []  # no file yet: idle tick
        _write(path, "one", "two")
        assert await next_lines(follower, 2) == ["one", "two"]
        # rotation: what was written just before the rename is still read, then the new file
        _write(path, "three")
        path.rename(tmp_path / "m.log.1")
        _write(path, "four")
        assert await next_lines(follower, 2) == ["three", "four"]
        # truncation in place (copytruncate): seen at the next look, then read from the start
        path.write_text("")
        assert await asyncio.wait_for(follower.__anext__(), 5) == []
        _write(path, "five")
        assert await next_lines(follower, 1) == ["five"]
    finally:
        await follower.aclose()


async def test_follow_from_a_cursor_skips_what_was_served(tmp_path: Path) -> None:
    path = tmp_path / "m.log"
    _write(path, "old 1", "old 2")
    lines, cursor = FileLog(path, "m").read(None, 1)
    assert texts(lines) == ["old 2"]
    follower = FileLog(path, "m").follow(cursor, poll_s=0.01)
    try:
        _write(path, "new")
        assert await next_lines(follower, 1) == ["new"]
    finally:
        await follower.aclose()


# ---- rotation when a child starts --------------------------------------------------------------


def test_rotate_log_keeps_n_backups(tmp_path: Path) -> None:
    path = tmp_path / "m.log"
    rotate_log(path, 10, 2)  # missing: nothing to do
    for generation in range(4):
        path.write_text(f"gen {generation} " + "x" * 20)
        rotate_log(path, 10, 2)
        assert not path.exists()
    assert (tmp_path / "m.log.1").read_text().startswith("gen 3")
    assert (tmp_path / "m.log.2").read_text().startswith("gen 2")
    assert not (tmp_path / "m.log.3").exists()
    path.write_text("small")
    rotate_log(path, 10, 2)
    assert path.read_text() == "small"  # under the limit: kept
    path.write_text("x" * 50)
    rotate_log(path, 0, 2)
    assert path.exists()  # 0: never
    rotate_log(path, 10, 0)
    assert not path.exists()  # no backups: dropped


async def test_child_process_rotates_its_log_on_start(tmp_path: Path) -> None:
    from modelyard.proc.process import ChildProcess

    path = tmp_path / "c.log"
    path.write_text("previous run\n" * 10)
    child = ChildProcess(["sh", "-c", "echo fresh"], name="c", log_file=path,
                         log_max_bytes=50, log_backups=1)
    await child.start()
    assert await child.wait() == 0
    assert path.read_text() == "fresh\n"
    assert (tmp_path / "c.log.1").read_text().startswith("previous run")


# ---- the in-memory ring ------------------------------------------------------------------------


def test_ring_keeps_records_with_seqs_and_tags() -> None:
    ring = LogBuffer(capacity=5)
    front = logging.getLogger("test.logs.front")
    engine = logging.getLogger("modelyard.engine.ledger")
    front.setLevel(logging.INFO)
    engine.setLevel(logging.INFO)
    with ring.capture(front), ring.capture(engine):
        front.info("hello %s", "front")
        engine.warning("from the engine")
        front.info("login with Authorization: Bearer my-abcdefghijklmnopqrstuvwxyz0123456789")
    # no engine in this process: engine loggers are the front's own records
    lines, cursor = BufferLog(ring, FRONT).read(None, 10)
    assert texts(lines) == ["test.logs.front: hello front",
                            "modelyard.engine.ledger: from the engine",
                            "test.logs.front: login with Authorization: Bearer [redacted]"]
    assert [x.seq for x in lines] == [1, 2, 3] and cursor == 3
    assert [x.level for x in lines] == ["info", "warning", "info"]
    assert all(x.ts is not None for x in lines)
    # single-process: they belong to the engine's source (decided when read)
    ring.engine_source = "engine-0"
    assert texts(BufferLog(ring, FRONT).read(None, 10)[0])[0] == "test.logs.front: hello front"
    assert [x.source for x in BufferLog(ring, "engine-0").read(None, 10)[0]] == ["engine-0"]
    assert BufferLog(ring, "engine-7").read(None, 10) == ([], 3)
    # after / limit / bounded capacity / an `after` from before a restart
    assert texts(BufferLog(ring, FRONT).read(1, 10)[0]) == [
        "test.logs.front: login with Authorization: Bearer [redacted]"]
    with ring.capture(front):
        for i in range(10):
            front.info("n%d", i)
    lines, cursor = BufferLog(ring, FRONT).read(0, 2)
    assert texts(lines) == ["test.logs.front: n5", "test.logs.front: n6"]
    assert cursor == lines[-1].seq == 10  # seqs 9..13 are kept
    assert texts(BufferLog(ring, FRONT).read(10**6, 1)[0]) == ["test.logs.front: n5"]
    assert not front.handlers and not engine.handlers  # capture() detached itself


async def test_ring_follow_delivers_new_records() -> None:
    ring = LogBuffer(capacity=100)
    logger = logging.getLogger("test.logs.follow")
    logger.setLevel(logging.INFO)
    with ring.capture(logger):
        logger.info("before")
        _, cursor = BufferLog(ring, FRONT).read(None, 10)
        follower = BufferLog(ring, FRONT).follow(cursor, poll_s=0.01)
        try:
            assert await asyncio.wait_for(follower.__anext__(), 5) == []
            logger.info("after")
            assert await next_lines(follower, 1) == ["test.logs.follow: after"]
        finally:
            await follower.aclose()


# ---- the routes over a stub front ---------------------------------------------------------------


@dataclass
class StubEngine:
    """An engine's client as far as the log routes use it: the engine reads its files."""

    name: str
    settings: Settings
    up: bool = True

    def _log(self, model: str | None) -> FileLog:
        if model is None:
            return FileLog(self.settings.logs_dir / f"{self.name}.log", self.name)
        return FileLog(log_path(self.settings, model), model)

    async def read_log(self, model: str | None, after: int | None, limit: int) -> Any:
        return self._log(model).read(after, limit)

    def follow_log(self, model: str | None, after: int) -> AsyncGenerator[list[LogLine], None]:
        return self._log(model).follow(after, poll_s=0.01)


@dataclass
class StubState:
    """FrontState's catalog, dispatcher and ops parts in one."""

    settings: Settings
    registry: ModelRegistry
    engines: list[Any] = field(default_factory=list)
    logs: LogBuffer = field(default_factory=lambda: LogBuffer(10))

    @property
    def catalog(self) -> StubState:
        return self

    dispatch = ops = catalog

    async def running_models(self) -> dict[str, EngineModel]:
        return {"m1": EngineModel("engine-1", ModelStatus(model="m1", state="ready"))}


async def _on_error(request: Any, exc: Exception) -> Any:
    assert isinstance(exc, ModelyardError)
    return render_error(request, exc)


@pytest.fixture
def client(tmp_path: Path) -> Any:
    models = [{"id": m, "backend": "openai", "argv": ["x"]} for m in ("m1", "m2")]
    settings = Settings(home=tmp_path, scan_hf_cache=False, models=models)  # type: ignore[arg-type]
    app = Starlette(routes=logs_api.routes, exception_handlers={ModelyardError: _on_error})
    app.state.front = StubState(settings, ModelRegistry.build(settings),
                                [StubEngine("engine-0", settings),
                                 StubEngine("engine-1", settings, up=False)])
    ring = LogBuffer(100)
    app.state.front.logs = ring
    logger = logging.getLogger("test.logs.routes")
    logger.setLevel(logging.INFO)
    with ring.capture(logger):
        logger.info("front says hi")
        settings.logs_dir.mkdir(parents=True)
        (settings.logs_dir / "engine-1.log").write_text("engine one\n")
        mlog = log_path(settings, "m1")
        mlog.parent.mkdir(parents=True)
        mlog.write_text("srv main: model loaded\nAuthorization: Bearer abc.def\n")
        with TestClient(app) as c:
            yield c


def test_route_reads_each_source(client: TestClient) -> None:
    body = client.get("/admin/logs").json()
    assert body["source"] == "front"
    assert texts_of(body) == ["test.logs.routes: front says hi"]
    assert body["next_after"] == 1
    assert {s["name"]: (s["kind"], s["engine"]) for s in body["sources"]} == {
        "front": ("front", None), "engine-0": ("engine", "engine-0"),
        "engine-1": ("engine", "engine-1"), "m1": ("model", "engine-1"), "m2": ("model", None)}
    assert texts_of(client.get("/admin/logs?engine=engine-1").json()) == ["engine one"]
    assert texts_of(client.get("/admin/logs?engine=1").json()) == ["engine one"]
    assert texts_of(client.get("/admin/logs?engine=engine-0").json()) == []  # not written yet
    model = client.get("/admin/logs", params={"model": "m1", "limit": 5}).json()
    assert texts_of(model) == ["srv main: model loaded", "Authorization: Bearer [redacted]"]
    assert model["lines"][0]["source"] == "m1"
    after = model["lines"][0]["seq"]
    assert texts_of(client.get(f"/admin/logs?model=m1&after={after}").json()) == [
        "Authorization: Bearer [redacted]"]


def texts_of(body: dict[str, Any]) -> list[str]:
    return [line["text"] for line in body["lines"]]


@pytest.mark.parametrize(
    ("query", "status", "code", "names"),
    [
        ("engine=engine-9", 404, "not_found", "engine-9"),
        ("model=nope", 404, "model_not_found", "nope"),
        ("model=nope", 404, "model_not_found", "nope"),
        ("limit=0", 400, "invalid_request", "limit"),
        ("after=x", 400, "invalid_request", "after"),
    ],
)
def test_route_errors_name_the_problem(
    client: TestClient, query: str, status: int, code: str, names: str
) -> None:
    for path in ("/admin/logs", "/admin/logs/stream"):
        r = client.get(f"{path}?{query}")
        assert r.status_code == status, r.text
        assert r.json()["error"] == code
        assert names in r.json()["message"]


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_stream_ends_when_the_client_leaves(tmp_path: Path, spec_version: str) -> None:
    """Called as the server calls it: first the last lines, then a new one, and once the client
    disconnects the call returns (no task left behind), whichever ASGI version says so."""
    models = [{"id": "m1", "backend": "openai", "argv": ["x"]}]
    settings = Settings(home=tmp_path, scan_hf_cache=False, models=models)  # type: ignore[arg-type]
    app = Starlette(routes=logs_api.routes, exception_handlers={ModelyardError: _on_error})
    app.state.front = StubState(settings, ModelRegistry.build(settings),
                                [StubEngine("engine-0", settings)])
    mlog = log_path(settings, "m1")
    mlog.parent.mkdir(parents=True)
    mlog.write_text("old line\n")
    sent: list[bytes] = []
    got_new = asyncio.Event()
    done_request = False

    async def receive() -> dict[str, Any]:
        nonlocal done_request
        if not done_request:
            done_request = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await got_new.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            sent.append(message.get("body", b""))
            if b"new line" in b"".join(sent):
                got_new.set()
            elif b"old line" in sent[-1]:
                _write(mlog, "new line")  # written once the stream is open

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version},
             "method": "GET", "path": "/admin/logs/stream", "raw_path": b"/admin/logs/stream",
             "query_string": b"model=m1", "headers": [], "scheme": "http", "server": ("t", 80),
             "client": ("c", 1), "root_path": "", "app": app}
    tasks_before = asyncio.all_tasks()
    await asyncio.wait_for(app(scope, receive, send), 10)
    body = b"".join(sent).decode()
    assert body.index("old line") < body.index("new line")
    assert 'data: {"seq":' in body and "id: " in body
    assert asyncio.all_tasks() == tasks_before


def test_json_records_give_their_time_level_and_request_id() -> None:
    line = parse_line('{"ts": "2026-11-22T07:20:14.123+00:00", "level": "warning", '
                      '"logger": "modelyard.engine", "process": "engine-0", '
                      '"message": "loading m1", "request_id": "abc"}', 7, "engine-0")
    assert (line.level, line.seq) == ("warning", 7)
    assert line.ts == pytest.approx(1795332014.123)
    assert line.text == "modelyard.engine: loading m1 request_id=abc"
    assert parse_line("{not json", 8, "x").text == "{not json"
