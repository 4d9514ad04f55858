"""The activity view's parts without a server: the ring keeps the last N rows, filters and
visibility (admins all, users their own, anonymous none), the requests in flight, the live feed
(a slow client is dropped, never waited for), the redaction of captured bodies, and the metrics
middleware's capture hook (off: nothing captured; on: both bodies, bounded)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient
from starlette.types import Receive, Scope, Send

from modelyard import metrics
from modelyard.front.identity.principal import ANONYMOUS_ADMIN, ANONYMOUS_INFERENCE, Principal
from modelyard.front.ops.activity import Activity, Filters
from modelyard.front.ops.activity_capture import redact_body
from modelyard.front.ops.metrics import RequestMetrics
from modelyard.front.ops.request_log import RequestLog, RequestRecord

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

ADMIN = Principal("root", True, frozenset({"inference", "admin"}), "session")
ALICE = Principal("alice", False, frozenset({"inference"}), "token", token_id="t1")
BOB = Principal("bob", False, frozenset({"inference"}), "token", token_id="t2")


def record(n: int, *, user: str | None = "alice", model: str = "m1", status: str = "200",
           **fields: Any) -> RequestRecord:
    base: dict[str, Any] = dict(
        request_id=f"r{n}", started_at=1000.0 + n, user=user, token_id="t1", api="openai",
        path="/v1/chat/completions", model=model, status=status, prompt_tokens=10,
        cached_tokens=4, completion_tokens=20, ttft_s=0.5, duration_s=2.5, queue_wait_s=0.1,
        swapped=False, streamed=True)
    return RequestRecord(**{**base, **fields})


def ids(rows: list[dict[str, Any]]) -> list[str]:
    return [r["id"] for r in rows]


def test_the_ring_keeps_the_last_entries_newest_first() -> None:
    activity = Activity(3)
    for n in range(5):
        activity(record(n))
    assert ids(activity.recent(ADMIN, Filters(), 10)) == ["r4", "r3", "r2"]
    assert ids(activity.recent(ADMIN, Filters(), 2)) == ["r4", "r3"]


def test_a_row_carries_every_figure() -> None:
    activity = Activity(10)
    activity.note_capture("a" * 32)
    activity(record(1, swapped=True, batch_id="batch_1"))
    row = activity.recent(ADMIN, Filters(), 1)[0]
    assert row == {
        "id": "r1", "time": 1001.0, "owner": "alice", "token_id": "t1", "model": "m1",
        "api": "openai", "path": "/v1/chat/completions", "status": "200", "prompt_tokens": 10,
        "cached_tokens": 4, "completion_tokens": 20, "ttft_s": 0.5, "tokens_per_s": 10.0,
        "duration_s": 2.5, "queue_wait_s": 0.1, "swapped": True, "batch_id": "batch_1",
        "capture_id": "a" * 32,
    }
    activity(record(2))  # a capture belongs to its own request only
    assert activity.recent(ADMIN, Filters(), 1)[0]["capture_id"] is None


def test_filters() -> None:
    activity = Activity(10)
    activity(record(1, model="m1"))
    activity(record(2, model="m2", status="429"))
    activity(record(3, model="m2", user="bob", status="stream_error"))
    activity(record(4, user=None))
    assert ids(activity.recent(ADMIN, Filters(model="m2"), 10)) == ["r3", "r2"]
    assert ids(activity.recent(ADMIN, Filters(status="ok"), 10)) == ["r4", "r1"]
    assert ids(activity.recent(ADMIN, Filters(status="error"), 10)) == ["r3", "r2"]
    assert ids(activity.recent(ADMIN, Filters(status="429"), 10)) == ["r2"]
    assert ids(activity.recent(ADMIN, Filters(owner="bob"), 10)) == ["r3"]
    assert ids(activity.recent(ADMIN, Filters(owner="alice", model="m2"), 10)) == ["r2"]
    assert ids(activity.recent(ADMIN, Filters(api="ollama"), 10)) == []


def test_each_caller_sees_only_their_own_and_admins_all() -> None:
    activity = Activity(10)
    activity(record(1, user="alice"))
    activity(record(2, user="bob"))
    activity(record(3, user=None))
    assert ids(activity.recent(ADMIN, Filters(), 10)) == ["r3", "r2", "r1"]
    assert ids(activity.recent(ANONYMOUS_ADMIN, Filters(), 10)) == ["r3", "r2", "r1"]
    assert ids(activity.recent(ALICE, Filters(), 10)) == ["r1"]
    assert ids(activity.recent(ALICE, Filters(owner="bob"), 10)) == []  # no peeking by filter
    assert ids(activity.recent(BOB, Filters(), 10)) == ["r2"]
    assert ids(activity.recent(ANONYMOUS_INFERENCE, Filters(), 10)) == []


def test_requests_in_flight_are_listed_until_they_end() -> None:
    activity = Activity(10)
    waiting, answering = metrics.Request("openai"), metrics.Request("ollama")
    waiting.model, answering.model = "m1", "m2"
    answering.first_at = answering.started
    activity.begin(waiting, {"path": "/v1/chat/completions", "modelyard.principal": ALICE}, "a")
    activity.begin(answering, {"path": "/api/chat", "modelyard.principal": BOB}, "b")
    rows = activity.in_flight(ADMIN, Filters(), now=waiting.started + 3.0)
    assert [(r["id"], r["state"], r["owner"]) for r in rows] == [
        ("a", "waiting", "alice"), ("b", "answering", "bob")]
    assert rows[0]["elapsed_s"] == pytest.approx(3.0)
    assert ids(activity.in_flight(ALICE, Filters())) == ["a"]
    assert ids(activity.in_flight(ADMIN, Filters(model="m2"))) == ["b"]
    activity.end(waiting)
    assert ids(activity.in_flight(ADMIN, Filters())) == ["b"]


async def test_the_feed_delivers_visible_rows_and_drops_a_slow_client() -> None:
    activity = Activity(100, feed_rows=2)
    mine = activity.subscribe(ALICE, Filters())
    slow = activity.subscribe(ADMIN, Filters())
    activity(record(1, user="bob"))  # not alice's: she is not sent it
    activity(record(2))
    got = await mine.next(1.0)
    assert got is not None and got["id"] == "r2"
    assert activity.feeds == 2
    activity(record(3))  # the admin has read nothing: its third row overflows
    assert slow.dropped and activity.feeds == 1
    assert await slow.next(1.0) is None  # its stream ends at once
    got = await mine.next(1.0)
    assert got is not None and got["id"] == "r3"
    assert await mine.next(0.05) is None  # nothing more: a keepalive
    activity.unsubscribe(mine)
    assert activity.feeds == 0


async def test_a_waiting_feed_wakes_on_a_row() -> None:
    activity = Activity(10)
    feed = activity.subscribe(ADMIN, Filters())
    waiter = asyncio.ensure_future(feed.next(10.0))
    await asyncio.sleep(0)  # let it start waiting (no time passes)
    activity(record(7))
    got = await asyncio.wait_for(waiter, 5)
    assert got is not None and got["id"] == "r7"


# ---- redaction -------------------------------------------------------------------------------


def test_a_json_body_loses_every_credential_field_at_any_depth() -> None:
    body = orjson.dumps({
        "model": "m1", "max_tokens": 5, "api_key": "hunter2-key",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"auth": {"password": "hunter2-pass", "client_secret": "hunter2-cs"}}],
        "headers": {"Authorization": "Basic aHVudGVyMg==", "X-Api-Key": "hunter2-x"},
        "github_token": "hunter2-gh",
    })
    text = redact_body(body, whole=True)
    assert "hunter2" not in text and "aHVudGVyMg" not in text
    data = orjson.loads(text)
    assert data["max_tokens"] == 5 and data["messages"][0]["content"] == "hi"
    assert data["api_key"] == "[redacted]"


def test_credentials_in_text_are_redacted_too() -> None:
    secret = "my-" + "A" * 30
    cut = b'{"messages":[{"content":"use Bearer ' + secret.encode() + b' and password=hunter2'
    text = redact_body(cut, whole=False)  # cut short: not JSON, redacted as text
    assert secret not in text and "hunter2" not in text
    assert "Bearer [redacted]" in text


# ---- the middleware's capture hook -----------------------------------------------------------


async def _echo(request: Request) -> Response:
    await request.body()
    metrics.note_model("m1")
    return Response(b'{"answer":"' + b"x" * 300 + b'","token":"hunter2-out"}',
                    media_type="application/json")


class _Archive:
    """What Capture.save uses of the archive: the saves are recorded, not written."""

    default_retention = "1d"

    def __init__(self) -> None:
        self.saved: list[tuple[Any, ...]] = []

    def save(self, *args: Any) -> tuple[Any, ...]:
        return args

    def spawn(self, work: tuple[Any, ...]) -> None:
        self.saved.append(work)


def _app(capture: bool, limit: int = 100) -> tuple[TestClient, Activity, _Archive]:
    inner = Starlette(routes=[Route("/v1/chat/completions", _echo, methods=["POST"])])
    activity, archive, log = Activity(10), _Archive(), RequestLog()
    log.add_sink(activity)
    settings = SimpleNamespace(activity_capture_bodies=capture, activity_capture_max_bytes=limit)
    inner.state.front = SimpleNamespace(
        ops=SimpleNamespace(requests=log, activity=activity), archive=archive,
        catalog=SimpleNamespace(settings=settings))

    async def with_principal(scope: Scope, receive: Receive, send: Send) -> None:
        scope["modelyard.principal"] = ALICE
        await inner(scope, receive, send)

    metered = RequestMetrics(with_principal)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = inner
        await metered(scope, receive, send)

    return TestClient(app), activity, archive


BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "api_key": "hunter2-in"}


def test_capture_off_saves_nothing_and_the_row_has_no_capture() -> None:
    client, activity, archive = _app(capture=False)
    assert client.post("/v1/chat/completions", json=BODY).status_code == 200
    assert archive.saved == []
    [row] = activity.recent(ADMIN, Filters(), 10)
    assert row["capture_id"] is None and row["model"] == "m1"
    assert activity.in_flight(ADMIN, Filters()) == []  # it ended


@pytest.mark.parametrize("how", ["option", "header"])
def test_capture_keeps_both_bodies_bounded_and_redacted(how: str) -> None:
    client, activity, archive = _app(capture=how == "option")
    headers = {"X-Modelyard-Capture": "on"} if how == "header" else {}
    assert client.post("/v1/chat/completions", json=BODY, headers=headers).status_code == 200
    [(owner, retention, item, item_id)] = archive.saved
    assert (owner, retention, item.kind, item.model) == ("alice", "1d", "activity", "m1")
    [row] = activity.recent(ADMIN, Filters(), 10)
    assert row["capture_id"] == item_id
    doc = orjson.loads(item.data)
    request, response = doc["request"], doc["response"]
    assert not request["truncated"] and orjson.loads(request["body"])["api_key"] == "[redacted]"
    assert response["truncated"] and response["bytes"] > 100  # kept 100 bytes of it
    assert len(response["body"]) == 100
    assert "hunter2" not in item.data.decode()
