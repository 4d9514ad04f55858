"""The activity view through a real `modelyard serve` with fake backends: each request appears
with its tokens, TTFT, status, queue wait and whether it waited for a load; a user sees only
their own; the live feed sends a row as a request finishes, and a client that does not read it
slows nobody; bodies are captured only when asked, redacted, into the archive (the owner's,
files 0600, with the caller's retention).

The ring, the filters and dropping a slow feed are tested without a server in
tests/unit/test_activity.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import stat
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tests.integration.harness import HELLO, config
from tests.support import Server, fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

Headers = dict[str, str]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = config(
        fake_model("cold", "--load-time-s", "0.3"),
        fake_model("busy", "--tokens-per-s", "20", max_concurrency=1),
        fake_model("quick"),
    )
    s = Server(tmp_path_factory.mktemp("front"), cfg, "--single-process")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def _token(server: Server, owner: str, **fields: Any) -> Headers:
    r = httpx.post(server.url + "/admin/users", headers=server.admin_headers, timeout=10,
                   json={"name": owner, "password": f"{owner}-password-1", "is_admin": False,
                         "must_change_password": False})
    assert r.status_code in (201, 409), r.text
    r = httpx.post(server.url + "/tokens", headers=server.admin_headers, timeout=10,
                   json={"name": f"{owner}-{len(fields)}", "scopes": ["inference"],
                         "owner": owner, **fields})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


@pytest.fixture(scope="module")
def alice(server: Server) -> Headers:
    return _token(server, "alice", archive_retention="1h")


@pytest.fixture(scope="module")
def bob(server: Server) -> Headers:
    return _token(server, "bob")


def chat(server: Server, who: Headers, model: str, *, max_tokens: int = 3,
         extra: dict[str, Any] | None = None, **headers: str) -> httpx.Response:
    body = {"model": model, "messages": HELLO, "max_tokens": max_tokens, **(extra or {})}
    r = httpx.post(server.url + "/v1/chat/completions", json=body,
                   headers={**who, **headers}, timeout=30)
    assert r.status_code == 200, r.text
    return r


def activity(server: Server, who: Headers, **query: Any) -> dict[str, Any]:
    r = httpx.get(server.url + "/activity", params=query, headers=who, timeout=10)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def row_of(server: Server, who: Headers, request_id: str) -> dict[str, Any]:
    """The row of `request_id` (its record is emitted as the response ends: poll for it)."""
    def find() -> dict[str, Any] | None:
        rows = activity(server, who)["requests"]
        return next((r for r in rows if r["id"] == request_id), None)

    return poll(find, timeout_s=10, what=f"the activity row of {request_id}")


def test_a_cold_model_swaps_then_a_warm_one_does_not(server: Server, alice: Headers) -> None:
    first = chat(server, alice, "cold")
    second = chat(server, alice, "cold")
    cold = row_of(server, server.admin_headers, first.headers["x-request-id"])
    warm = row_of(server, server.admin_headers, second.headers["x-request-id"])
    assert cold["swapped"] is True and warm["swapped"] is False
    assert cold["duration_s"] >= 0.3  # it waited for the load
    usage = second.json()["usage"]
    assert (warm["prompt_tokens"], warm["completion_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"])
    assert warm["completion_tokens"] == 3
    assert (warm["owner"], warm["model"], warm["api"], warm["status"]) == (
        "alice", "cold", "openai", "200")
    assert warm["token_id"]
    assert warm["capture_id"] is None  # capture is off by default


def test_a_queued_request_shows_its_queue_wait(server: Server, alice: Headers) -> None:
    chat(server, alice, "busy", max_tokens=1)  # loaded: the wait below is the queue's alone
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: chat(server, alice, "busy", max_tokens=10), range(2)))
    rows = [row_of(server, alice, r.headers["x-request-id"]) for r in answers]
    waits = sorted(r["queue_wait_s"] for r in rows)
    # max_concurrency 1, 10 tokens at 20/s: the second waited for most of the first's 0.5 s
    assert waits[0] < 0.2 and waits[1] >= 0.3, rows
    assert all(not r["swapped"] for r in rows)


def test_a_user_sees_only_their_own(server: Server, alice: Headers, bob: Headers) -> None:
    mine = chat(server, alice, "quick").headers["x-request-id"]
    theirs = chat(server, bob, "quick").headers["x-request-id"]
    row_of(server, server.admin_headers, theirs)
    row_of(server, server.admin_headers, mine)
    bobs = activity(server, bob)["requests"]
    assert {r["owner"] for r in bobs} == {"bob"} and theirs in {r["id"] for r in bobs}
    assert activity(server, bob, owner="alice")["requests"] == []
    alices = activity(server, alice, model="quick")["requests"]
    assert [r["id"] for r in alices] == [mine]
    everyone = activity(server, server.admin_headers, model="quick")["requests"]
    assert {mine, theirs} <= {r["id"] for r in everyone}
    r = httpx.get(server.url + "/activity", timeout=10)  # no identity at all
    assert r.status_code == 401


def test_the_live_feed_sends_a_row_as_a_request_finishes(server: Server, alice: Headers) -> None:
    with httpx.stream("GET", server.url + "/activity/stream", headers=alice,
                      params={"model": "quick"}, timeout=30) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        lines = stream.iter_lines()
        assert next(lines) == ": following"  # subscribed: what finishes from now on is sent
        sent = chat(server, alice, "quick", max_tokens=8, extra={"stream": True})
        for line in lines:
            if line.startswith("data: "):
                row = json.loads(line[6:])
                break
    assert row["id"] == sent.headers["x-request-id"]
    assert (row["owner"], row["status"], row["completion_tokens"]) == ("alice", "200", 8)
    # a stream's first token has a time, and the rest a rate
    assert row["ttft_s"] is not None and 0 <= row["ttft_s"] <= row["duration_s"]
    assert row["tokens_per_s"] is None or row["tokens_per_s"] > 0


def test_a_client_that_does_not_read_the_feed_slows_nobody(server: Server,
                                                           alice: Headers) -> None:
    with httpx.stream("GET", server.url + "/activity/stream", headers=server.admin_headers,
                      timeout=30) as idle:  # never read past its headers
        assert idle.status_code == 200
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            done = list(pool.map(lambda _: chat(server, alice, "quick", max_tokens=1),
                                 range(40)))
    assert len(done) == 40
    row_of(server, alice, done[-1].headers["x-request-id"])


def test_capture_on_request_archives_redacted_bodies(server: Server, alice: Headers,
                                                     bob: Headers) -> None:
    secret_token = "my-" + "S" * 32
    extra = {"api_key": "hunter2-body-key",
             "metadata": {"password": "hunter2-password"},
             "messages": [{"role": "user", "content": f"Authorization: Bearer {secret_token}"}]}
    r = chat(server, alice, "quick", extra=extra, **{"X-Modelyard-Capture": "on"})
    row = row_of(server, alice, r.headers["x-request-id"])
    item_id = row["capture_id"]
    assert item_id

    def saved() -> httpx.Response | None:
        got = httpx.get(f"{server.url}/archive/{item_id}", headers=alice, timeout=10)
        return got if got.status_code == 200 else None

    item = poll(saved, timeout_s=10, what="the captured bodies").json()
    assert (item["kind"], item["owner"], item["model"]) == ("activity", "alice", "quick")
    assert item["retention"] == "1h"  # alice's token's default, as the archive's rule says
    assert item["expires_at"] == pytest.approx(item["created_at"] + 3600)
    content = httpx.get(f"{server.url}/archive/{item_id}/content", headers=alice, timeout=10)
    assert content.status_code == 200
    text = content.text
    assert "hunter2" not in text and secret_token not in text
    doc = json.loads(text)
    assert doc["request_id"] == r.headers["x-request-id"]
    sent = json.loads(doc["request"]["body"])
    assert sent["model"] == "quick" and sent["api_key"] == "[redacted]"
    answer = json.loads(doc["response"]["body"])
    assert answer["choices"][0]["message"]["content"] == r.json()["choices"][0]["message"][
        "content"]
    path = server.home / "archive" / item_id
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # another user cannot read it; the admin can
    assert httpx.get(f"{server.url}/archive/{item_id}", headers=bob, timeout=10).status_code == 404
    admin = httpx.get(f"{server.url}/archive/{item_id}", headers=server.admin_headers, timeout=10)
    assert admin.status_code == 200


def test_capture_off_archives_nothing(server: Server, bob: Headers) -> None:
    r = chat(server, bob, "quick", extra={"api_key": "hunter2"})
    row = row_of(server, bob, r.headers["x-request-id"])
    assert row["capture_id"] is None
    items = httpx.get(server.url + "/archive", params={"kind": "activity"}, headers=bob,
                      timeout=10)
    assert items.status_code == 200 and items.json()["items"] == []
