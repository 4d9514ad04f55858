"""The archive store, its retention rules, its routes and what the APIs hand it, in process.

The store runs on a real SQLite file and a real directory; time is an injected clock. The routes
run in a tiny Starlette app whose middleware attaches the caller (as the auth gate does).
"""

from __future__ import annotations

import asyncio
import base64
import os
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
import pytest
import sqlalchemy as sa
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from modelyard import db
from modelyard.config import Settings
from modelyard.errors import ArchiveItemNotFound, InvalidRequest, ModelyardError
from modelyard.front.api import archive as archive_api
from modelyard.front.archive import capture as archive_capture
from modelyard.front.archive.store import (
    RETENTION_S,
    ArchiveStore,
    NewItem,
    effective_retention,
    expires_at,
    parse_retention,
    safe_filename,
)
from modelyard.front.identity.principal import Principal
from modelyard.front.render import render_error

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]

ALICE = Principal("alice", False, frozenset({"inference"}), "token")
BOB = Principal("bob", False, frozenset({"inference"}), "session")
ADMIN = Principal("root", True, frozenset({"inference", "admin"}), "session")
ANON = Principal(None, False, frozenset({"inference"}), "anonymous")
T0 = 1_800_000_000.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def database(database_url: str) -> Iterator[sa.Engine]:
    engine = db.connect(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def store(database: sa.Engine, tmp_path: Path, clock: Clock
                ) -> AsyncIterator[ArchiveStore]:
    s = ArchiveStore(database, tmp_path / "archive", clock=clock, sweep_interval_s=3600)
    await s.start()
    yield s
    await s.stop()


def item(kind: str = "image", data: bytes = b"\x89PNG\r\n\x1a\nfox", name: str = "fox.png",
         media_type: str = "image/png") -> NewItem:
    return NewItem(kind, data, media_type, name, model="painter", meta={"prompt": "a fox"})


# ---- retention ----------------------------------------------------------------------------------


def test_the_six_retentions_and_their_lengths() -> None:
    day = 86400.0
    lengths = {"1h": 3600.0, "1d": day, "1w": 7 * day, "1m": 30 * day, "1y": 365 * day,
               "never": None}
    assert lengths == RETENTION_S
    assert parse_retention(" 1W ", "archive") == "1w"
    assert expires_at("1m", T0) == T0 + 30 * day
    assert expires_at("1y", T0) == T0 + 365 * day
    assert expires_at("never", T0) is None


@pytest.mark.parametrize("bad", ["2h", "1", "forever", "", None, 7, "1h;rm"])
def test_an_invalid_retention_is_400_naming_the_parameter(bad: object) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_retention(bad, "X-Modelyard-Archive")
    assert err.value.param == "X-Modelyard-Archive"
    assert "1h, 1d, 1w, 1m" in err.value.message


def test_effective_retention_request_then_token_or_user_then_server() -> None:
    with_default = Principal("alice", False, frozenset({"inference"}), "token",
                             archive_retention="1d")
    assert effective_retention("1h", with_default, "1w") == "1h"
    assert effective_retention(None, with_default, "1w") == "1d"
    assert effective_retention(None, ALICE, "1y") == "1y"


def test_settings_default_retention_is_a_week_and_checked() -> None:
    assert Settings().archive_retention == "1w"
    with pytest.raises(ValueError, match="archive_retention"):
        Settings(archive_retention="2w")  # type: ignore[arg-type]


# ---- file names ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "safe"), [
    ("fox.png", "fox.png"),
    ("../../etc/passwd", "passwd"),
    ("..\\..\\windows\\win.ini", "win.ini"),
    ("..", "item"),
    ("", "item"),
    (".bashrc", "bashrc"),
    ('a"b;c\r\nSet-Cookie: x=1.txt', "a_b_c_Set-Cookie_x_1.txt"),
    ("chat-smøl lm/2:q4.json", "2_q4.json"),
    ("chat-smøl lm 2:q4.json", "chat-sm_l_lm_2_q4.json"),
])  # fmt: skip
def test_download_names_are_one_plain_component(name: str, safe: str) -> None:
    assert safe_filename(name) == safe


def test_a_long_name_keeps_its_extension() -> None:
    out = safe_filename("x" * 300 + ".json")
    assert len(out) == 120 and out.endswith(".json")


# ---- the store ----------------------------------------------------------------------------------


async def test_save_writes_a_private_file_named_by_a_random_id(store: ArchiveStore) -> None:
    saved = await store.save("alice", "1d", item(name="../../x/evil name.png"))
    assert len(saved["id"]) == 32 and int(saved["id"], 16) >= 0
    path = store.root / saved["id"]
    assert path.read_bytes() == b"\x89PNG\r\n\x1a\nfox"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in store.root.iterdir()) == [saved["id"]]  # nothing else
    assert saved["filename"] == "evil_name.png"
    assert saved | {"id": None} == {
        "id": None, "owner": "alice", "kind": "image", "model": "painter",
        "filename": "evil_name.png", "media_type": "image/png", "size_bytes": 11,
        "retention": "1d", "created_at": T0, "expires_at": T0 + 86400, "meta": {"prompt": "a fox"},
    }  # fmt: skip
    again = await store.save("alice", "1d", item())
    assert again["id"] != saved["id"]


async def test_owners_see_their_own_items_and_admins_all(store: ArchiveStore) -> None:
    mine = await store.save("alice", "1w", item())
    theirs = await store.save("bob", "1w", item())
    anonymous = await store.save(None, "1w", item())

    def ids(items: list[dict[str, Any]]) -> set[str]:
        return {i["id"] for i in items}

    assert ids(await store.list_items(ALICE)) == {mine["id"]}
    assert ids(await store.list_items(BOB)) == {theirs["id"]}
    assert ids(await store.list_items(ADMIN)) == {mine["id"], theirs["id"], anonymous["id"]}
    assert await store.list_items(ANON) == []  # anonymous items: admins only
    assert ids(await store.list_items(ADMIN, owner="bob")) == {theirs["id"]}
    assert await store.list_items(ALICE, owner="bob") == []  # `owner` never widens a list

    assert (await store.get(ALICE, mine["id"]))["owner"] == "alice"
    for who, item_id in [(ALICE, theirs["id"]), (BOB, mine["id"]), (ALICE, anonymous["id"]),
                         (ANON, anonymous["id"])]:
        with pytest.raises(ArchiveItemNotFound):
            await store.get(who, item_id)
        with pytest.raises(ArchiveItemNotFound):
            await store.content(who, item_id)
        with pytest.raises(ArchiveItemNotFound):
            await store.delete(who, item_id)
    assert len(list(store.root.iterdir())) == 3  # nothing was deleted by the others
    for item_id in (mine["id"], theirs["id"], anonymous["id"]):
        assert (await store.get(ADMIN, item_id))["id"] == item_id


async def test_list_filters_orders_and_pages(store: ArchiveStore, clock: Clock) -> None:
    made = []
    for i, kind in enumerate(["image", "speech", "chat", "image"]):
        clock.now = T0 + i
        made.append(await store.save("alice", "1w", item(kind=kind)))
    listed = await store.list_items(ALICE)
    assert [i["id"] for i in listed] == [m["id"] for m in reversed(made)]  # newest first
    images = await store.list_items(ALICE, kind="image")
    assert [i["id"] for i in images] == [made[3]["id"], made[0]["id"]]
    page = await store.list_items(ALICE, limit=2)
    rest = await store.list_items(ALICE, before=page[-1]["created_at"])
    assert [i["id"] for i in page + rest] == [i["id"] for i in listed]


@pytest.mark.parametrize("bad_id", ["../modelyard.db", "..", "a" * 31, "A" * 32, "0" * 32 + "/",
                                    "%2e%2e", "0" * 31 + "\x00"])
async def test_ids_that_we_did_not_make_are_not_found(store: ArchiveStore, bad_id: str) -> None:
    (store.root.parent / "modelyard.db.secret").write_text("x")
    with pytest.raises(ArchiveItemNotFound):
        await store.content(ADMIN, bad_id)
    with pytest.raises(ArchiveItemNotFound):
        await store.delete(ADMIN, bad_id)
    assert (store.root.parent / "modelyard.db.secret").exists()


async def test_content_and_delete(store: ArchiveStore) -> None:
    saved = await store.save("alice", "never", item(data=b"bytes"))
    found, path = await store.content(ALICE, saved["id"])
    assert found == saved and path.read_bytes() == b"bytes"
    assert saved["expires_at"] is None
    await store.delete(ALICE, saved["id"])
    assert not path.exists()
    with pytest.raises(ArchiveItemNotFound):
        await store.get(ALICE, saved["id"])
    with pytest.raises(ArchiveItemNotFound):
        await store.delete(ALICE, saved["id"])


async def test_expired_items_vanish_at_once_and_the_sweep_deletes_them(
    store: ArchiveStore, clock: Clock
) -> None:
    # Only the sweeps below delete here: the background sweeper, woken by each save, would
    # otherwise delete the hour's file as soon as the clock moves (it raced this test in CI).
    await store.stop()
    hour = await store.save("alice", "1h", item())
    day = await store.save("alice", "1d", item())
    kept = await store.save("alice", "never", item())
    clock.now = T0 + 3600  # the hour is up
    assert {i["id"] for i in await store.list_items(ALICE)} == {day["id"], kept["id"]}
    with pytest.raises(ArchiveItemNotFound):
        await store.get(ADMIN, hour["id"])
    assert (store.root / hour["id"]).exists()  # until the sweep

    assert await store.sweep() == 1
    assert not (store.root / hour["id"]).exists()
    clock.now = T0 + 10 * 365 * 86400.0
    assert await store.sweep() == 1
    assert sorted(p.name for p in store.root.iterdir()) == [kept["id"]]
    assert [i["id"] for i in await store.list_items(ALICE)] == [kept["id"]]


async def test_start_removes_orphan_files_and_what_expired_while_down(
    database: sa.Engine, tmp_path: Path, clock: Clock
) -> None:
    first = ArchiveStore(database, tmp_path / "archive", clock=clock, sweep_interval_s=3600)
    await first.start()
    kept = await first.save("alice", "1w", item())
    gone = await first.save("alice", "1h", item())
    await first.stop()
    orphan = tmp_path / "archive" / ("ab" * 16)
    orphan.write_bytes(b"left by a crash between file and row")
    (tmp_path / "archive" / ("cd" * 16 + ".tmp")).write_bytes(b"half written")
    (tmp_path / "archive" / "README").write_text("not ours: left alone")

    clock.now = T0 + 7200
    second = ArchiveStore(database, tmp_path / "archive", clock=clock, sweep_interval_s=3600)
    await second.start()
    await asyncio.wait_for(second.next_pass(), 15)  # a busy 2-core CI machine is slow
    await second.stop()
    names = sorted(p.name for p in (tmp_path / "archive").iterdir())
    assert names == sorted([kept["id"], "README"])
    with database.connect() as conn:
        assert [r.id for r in conn.execute(sa.select(db.archive.c.id))] == [kept["id"]]
    assert gone["id"] not in names


async def test_the_sweeper_wakes_at_the_next_expiry(database: sa.Engine, tmp_path: Path) -> None:
    """A real-time clock moved forward to 0.3 s before an hour-long item expires: with an
    interval of two hours, only waking at the expiry deletes it within the test's bound."""
    shift = 0.0
    s = ArchiveStore(database, tmp_path / "archive", clock=lambda: time.time() + shift,
                     sweep_interval_s=7200)
    saved = await s.save("alice", "1h", item())
    shift = 3600 - 0.3
    await s.start()
    try:
        async def gone() -> None:
            while (s.root / saved["id"]).exists():
                await s.next_pass()

        await asyncio.wait_for(gone(), 5)
        assert await s.list_items(ADMIN) == []
    finally:
        await s.stop()


async def test_a_save_that_expires_first_reschedules_the_sweeper(
    database: sa.Engine, tmp_path: Path
) -> None:
    s = ArchiveStore(database, tmp_path / "archive", sweep_interval_s=7200)
    await s.start()
    try:
        await asyncio.wait_for(s.next_pass(), 5)  # then it sleeps for the interval: 2 h
        await s.save("alice", "1h", item())  # expires before that
        await asyncio.wait_for(s.next_pass(), 5)  # so it woke to plan again
        await s.save("alice", "1d", item())  # expires after its next wake: no pass
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(s.next_pass(), 0.3)
    finally:
        await s.stop()


async def test_stop_lets_background_saves_finish(store: ArchiveStore) -> None:
    store.spawn(store.save("alice", "1d", item()))
    store.spawn(store.save("alice", "1d", item()))
    await store.stop()
    assert len(await store.list_items(ALICE)) == 2


# ---- the routes ----------------------------------------------------------------------------------


class AttachPrincipal:
    """Stands in for the auth gate: `X-Test-User: name` (admin: `root`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            name = dict(scope["headers"]).get(b"x-test-user", b"").decode()
            scope["modelyard.principal"] = {"alice": ALICE, "bob": BOB, "root": ADMIN}.get(
                name, ANON)
        await self.app(scope, receive, send)


async def _on_error(request: Request, exc: Exception) -> Any:
    assert isinstance(exc, ModelyardError)
    return render_error(request, exc)


@pytest.fixture
async def api(store: ArchiveStore) -> AsyncIterator[Callable[..., Awaitable[httpx.Response]]]:
    app = Starlette(routes=archive_api.routes, exception_handlers={ModelyardError: _on_error})
    app.state.front = SimpleNamespace(archive=store)
    transport = httpx.ASGITransport(app=AttachPrincipal(app))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

        async def call(method: str, path: str, user: str = "alice") -> httpx.Response:
            return await client.request(method, path, headers={"X-Test-User": user})

        yield call


async def test_routes_list_get_download_and_delete(
    store: ArchiveStore, api: Callable[..., Awaitable[httpx.Response]]
) -> None:
    data = os.urandom(5000)
    saved = await store.save("alice", "1d", item("speech", data, 'say "hi"\r\n.wav', "audio/wav"))
    await store.save("bob", "1d", item())

    r = await api("GET", "/archive")
    assert r.status_code == 200 and r.json() == {"items": [saved]}
    assert (await api("GET", f"/archive/{saved['id']}")).json() == saved

    r = await api("GET", f"/archive/{saved['id']}/content")
    assert r.status_code == 200 and r.content == data
    assert r.headers["content-type"] == "audio/wav"
    assert r.headers["content-disposition"] == 'attachment; filename="say_hi_.wav"'
    assert r.headers["x-content-type-options"] == "nosniff"

    r = await api("GET", f"/archive/{saved['id']}/content", user="bob")
    assert r.status_code == 404 and r.json()["error"] == "archive_item_not_found"
    assert (await api("DELETE", f"/archive/{saved['id']}", user="bob")).status_code == 404

    r = await api("DELETE", f"/archive/{saved['id']}")
    assert r.status_code == 200 and r.json() == {"status": "deleted"}
    assert (await api("GET", f"/archive/{saved['id']}")).status_code == 404
    assert (await api("GET", "/archive")).json() == {"items": []}
    assert len((await api("GET", "/archive", user="root")).json()["items"]) == 1


@pytest.mark.parametrize(("query", "param"), [
    ("kind=video", "kind"), ("limit=0", "limit"), ("limit=501", "limit"), ("limit=2.5", "limit"),
    ("limit=x", "limit"), ("before=yesterday", "before"), ("before=nan", "before"),
])  # fmt: skip
async def test_route_parameters_are_checked(
    api: Callable[..., Awaitable[httpx.Response]], query: str, param: str
) -> None:
    r = await api("GET", f"/archive?{query}")
    assert r.status_code == 400, r.text
    assert r.json()["error"] == "invalid_request" and r.json()["param"] == param


async def test_traversal_through_the_route_is_not_found(
    api: Callable[..., Awaitable[httpx.Response]]
) -> None:
    for path in ("/archive/..%2Fmodelyard.db/content", "/archive/%2e%2e/content",
                 "/archive/" + "0" * 32 + "/content"):
        r = await api("GET", path, user="root")
        assert r.status_code == 404, (path, r.text)


# ---- what the APIs hand to the archive ----------------------------------------------------------


def plan(store: ArchiveStore, principal: Principal, headers: dict[str, str], *,
         default_on: bool, body_value: object = None) -> archive_capture.Plan | None:
    """The plan the API layer puts in a request's context (front/api/context.py) for a request
    with these `headers` and `archive` field `body_value`."""
    return archive_capture.plan_for(store, principal, headers.get("X-Modelyard-Archive"),
                                    default_on=default_on, body_value=body_value)


def test_chats_are_archived_only_when_asked(store: ArchiveStore) -> None:
    assert plan(store, ALICE, {}, default_on=False) is None
    assert plan(store, ALICE, {"X-Modelyard-Archive": "off"}, default_on=False) is None
    asked = plan(store, ALICE, {"X-Modelyard-Archive": "1h"}, default_on=False)
    assert asked is not None and (asked.owner, asked.retention) == ("alice", "1h")
    on = plan(store, ALICE, {"X-Modelyard-Archive": "on"}, default_on=False)
    assert on is not None and on.retention == "1w"  # the server's default
    field = plan(store, ALICE, {}, default_on=False, body_value=True)
    assert field is not None and field.retention == "1w"
    field = plan(store, ALICE, {}, default_on=False, body_value="never")
    assert field is not None and field.retention == "never"
    # The header wins over the body field.
    assert plan(store, ALICE, {"X-Modelyard-Archive": "off"}, default_on=False,
                body_value="1d") is None
    with_default = Principal("bob", False, frozenset(), "token", archive_retention="1y")
    token = plan(store, with_default, {"X-Modelyard-Archive": "yes"}, default_on=False)
    assert token is not None and token.retention == "1y"
    anon = plan(store, ANON, {"X-Modelyard-Archive": "1d"}, default_on=False)
    assert anon is not None and anon.owner is None


def test_service_outputs_are_archived_unless_off(store: ArchiveStore) -> None:
    default = plan(store, ALICE, {}, default_on=True)
    assert default is not None and default.retention == "1w"
    assert plan(store, ALICE, {"X-Modelyard-Archive": "off"}, default_on=True) is None


@pytest.mark.parametrize(("header", "field", "param"), [
    ("2h", None, "X-Modelyard-Archive"), (None, "sometimes", "archive"), (None, 3, "archive"),
])  # fmt: skip
def test_a_bad_archive_value_is_400_naming_where(
    store: ArchiveStore, header: str | None, field: object, param: str
) -> None:
    headers = {"X-Modelyard-Archive": header} if header else {}
    with pytest.raises(InvalidRequest) as err:
        plan(store, ALICE, headers, default_on=False, body_value=field)
    assert err.value.param == param


def sse(*events: Any) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)


def chunk(text: str | None, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


async def test_a_streamed_chat_is_saved_after_its_last_chunk(store: ArchiveStore) -> None:
    plan = archive_capture.Plan(store, "alice", "1d")
    request = {"model": "m", "messages": [{"role": "user", "content": "Say hi"}], "stream": True,
               "temperature": 0.5}
    capture = archive_capture.ChatCapture(plan, api="openai", endpoint="/v1/chat/completions",
                                          model="m", request=request, stream=True)
    usage = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}}
    wire = sse(chunk("Hi"), chunk(" there", "stop"), usage) + b"data: [DONE]\n\n"

    async def upstream() -> AsyncIterator[bytes]:
        for i in range(0, len(wire), 7):  # events split across reads
            yield wire[i : i + 7]

    relayed = [c async for c in capture.tap_sse(upstream())]
    assert b"".join(relayed) == wire  # unchanged
    await store.idle()
    [saved] = await store.list_items(ALICE)
    assert saved["kind"] == "chat" and saved["model"] == "m" and saved["retention"] == "1d"
    assert saved["meta"] | {"usage": None} == {
        "api": "openai", "endpoint": "/v1/chat/completions", "stream": True, "complete": True,
        "finish_reason": "stop", "usage": None, "title": "Say hi"}
    doc = orjson.loads((store.root / saved["id"]).read_bytes())
    assert doc["messages"] == [{"role": "user", "content": "Say hi"},
                               {"role": "assistant", "content": "Hi there"}]
    assert doc["parameters"] == {"temperature": 0.5}
    assert doc["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert doc["complete"] is True and saved["filename"].startswith("chat-m-")


async def test_a_stream_the_client_left_is_saved_as_incomplete(store: ArchiveStore) -> None:
    plan = archive_capture.Plan(store, None, "1h")
    capture = archive_capture.ChatCapture(plan, api="openai", endpoint="/v1/completions",
                                          model="m", request={"prompt": "Once"}, stream=True)
    more = asyncio.Event()

    async def upstream() -> AsyncIterator[bytes]:
        yield sse({"choices": [{"index": 0, "text": " upon"}]})
        yield b'data: {"choices": [{"index": 0, "te'  # cut mid-event
        await more.wait()  # never: the client leaves first

    stream = capture.tap_sse(upstream())
    assert b"upon" in await stream.__anext__()
    await stream.__anext__()
    capture._end_tap()  # what the response's background does when the client has gone
    await store.idle()
    [saved] = await store.list_items(ADMIN)
    assert saved["owner"] is None and saved["meta"]["complete"] is False
    doc = orjson.loads((store.root / saved["id"]).read_bytes())
    assert (doc["prompt"], doc["completion"], doc["complete"]) == ("Once", " upon", False)
    await stream.aclose()  # its own `finally` later: saved once, not twice
    await store.idle()
    assert len(await store.list_items(ADMIN)) == 1


async def test_an_image_answer_is_saved_image_by_image(store: ArchiveStore) -> None:
    plan = archive_capture.Plan(store, "alice", "1w")
    png, jpeg = b"\x89PNG\r\n\x1a\none", b"\xff\xd8\xff\xe0two"
    answer = orjson.dumps({"created": 1, "data": [
        {"b64_json": base64.b64encode(png).decode(), "revised_prompt": "a red fox"},
        {"b64_json": base64.b64encode(jpeg).decode()}]})
    capture = archive_capture.ServiceCapture(
        plan, kind="image", model="painter", request_body=b'{"prompt": "a fox", "n": 2}',
        request_type="application/json")
    items = capture.items(answer)
    assert [(i.kind, i.data, i.media_type) for i in items] == [
        ("image", png, "image/png"), ("image", jpeg, "image/jpeg")]
    assert items[0].meta == {"prompt": "a fox", "index": 0, "count": 2,
                             "revised_prompt": "a red fox"}
    assert items[0].filename.endswith("-1.png") and items[1].filename.endswith("-2.jpg")

    urls = orjson.dumps({"created": 1, "data": [{"url": "http://x/1.png"}]})
    [only] = capture.items(urls)  # nothing inlined: the answer itself is kept
    assert (only.data, only.media_type) == (urls, "application/octet-stream")


async def test_only_a_whole_service_output_is_saved(store: ArchiveStore) -> None:
    plan = archive_capture.Plan(store, "alice", "1w")

    async def audio(n: int) -> AsyncIterator[bytes]:
        for i in range(n):
            yield bytes([i]) * 10

    capture = archive_capture.ServiceCapture(
        plan, kind="speech", model="tts", request_body=b'{"input": "hello", "voice": "a"}',
        request_type="application/json")
    relayed = b"".join([c async for c in capture.tap(audio(3), "audio/wav")])
    await store.idle()
    [saved] = await store.list_items(ALICE)
    assert (store.root / saved["id"]).read_bytes() == relayed
    assert saved["media_type"] == "audio/wav" and saved["filename"].endswith(".wav")
    assert saved["meta"] == {"input": "hello", "voice": "a"}

    cut = capture.tap(audio(3), "audio/wav")
    await cut.__anext__()
    await cut.aclose()  # the client left
    await store.idle()
    assert len(await store.list_items(ALICE)) == 1
