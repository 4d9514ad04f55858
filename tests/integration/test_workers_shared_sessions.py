"""Chat sessions and stored responses across the workers of `serve --workers 2` (issue 33 item
4), on SQLite: a turn answered by one worker is the history of the next turn, sent at once to
the other; a session deleted on one is gone on the other; a response stored by one is continued,
retrieved and deleted on the other.

Each worker is reached on a kept-alive connection of its own (the kernel gives a connection to
one worker for its life): `pinned` opens connections until it holds one to each."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from tests.integration.harness import config, model_status
from tests.integration.test_workers_process import HEADER
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # No chat_session_persist: with several workers the sessions are in the database anyway.
    server = Server(tmp_path_factory.mktemp("workers-sessions"), config(fake_model("m")),
                    "--workers", "2")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def workers(server: Server) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """A kept-alive client on worker 0 and one on worker 1."""
    held: dict[str, httpx.Client] = {}
    for _ in range(200):
        client = httpx.Client(base_url=server.url, timeout=30)
        worker = client.get("/health").headers[HEADER]
        if worker in held:
            client.close()
        else:
            held[worker] = client
        if len(held) == 2:
            break
    try:
        assert sorted(held) == ["0/2", "1/2"], "both workers took a connection"
        yield held["0/2"], held["1/2"]
    finally:
        for client in held.values():
            client.close()


def turn(client: httpx.Client, sid: str, text: str, *, stream: bool = False) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2,
            "stream": stream}
    return client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": sid})


def sent(server: Server) -> list[dict[str, Any]]:
    """The chat bodies the fake backend was sent, oldest first."""
    found = model_status(server, "m")
    assert found is not None and found["upstream"]
    return list(httpx.get(found["upstream"] + "/requests", timeout=10).json())


def user_texts(body: dict[str, Any]) -> list[str]:
    return [m["content"] for m in body["messages"] if m["role"] == "user"]


def test_a_turn_on_one_worker_is_the_history_of_the_next_on_the_other(
    server: Server, workers: tuple[httpx.Client, httpx.Client],
) -> None:
    a, b = workers
    first = turn(a, "trip", "one")
    assert first.status_code == 200, first.text
    assert first.headers[HEADER] == "0/2"
    # At once, on the other worker, streamed: it sends the whole history upstream.
    with b.stream("POST", "/v1/chat/completions", headers={"X-Session-Id": "trip"}, json={
            "model": "m", "messages": [{"role": "user", "content": "two"}], "max_tokens": 2,
            "stream": True}) as second:
        assert second.status_code == 200 and second.headers[HEADER] == "1/2"
        assert b"[DONE]" in b"".join(second.iter_bytes())
    assert user_texts(sent(server)[-1]) == ["one", "two"]
    # The streamed turn's commit was written before its [DONE]: back on the first worker.
    third = turn(a, "trip", "three")
    assert third.status_code == 200, third.text
    assert user_texts(sent(server)[-1]) == ["one", "two", "three"]
    for client in (a, b):
        got = client.get("/v1/sessions/trip")
        assert got.status_code == 200, got.text
        assert got.json()["turns"] == 3
        assert [m["role"] for m in got.json()["messages"]] == ["user", "assistant"] * 3
        listed = client.get("/v1/sessions").json()["data"]
        assert "trip" in [s["id"] for s in listed]


def test_a_session_deleted_on_one_worker_is_gone_on_the_other(
    server: Server, workers: tuple[httpx.Client, httpx.Client],
) -> None:
    a, b = workers
    assert turn(a, "brief", "one").status_code == 200
    assert b.get("/v1/sessions/brief").status_code == 200  # B holds a copy now
    # Deleted on B (which did not make it): gone on A.
    assert b.delete("/v1/sessions/brief").status_code == 200
    gone = a.get("/v1/sessions/brief")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"
    assert "brief" not in [s["id"] for s in a.get("/v1/sessions").json()["data"]]
    # A turn naming it on A starts afresh: no history from before the delete.
    assert turn(a, "brief", "again").status_code == 200
    assert user_texts(sent(server)[-1]) == ["again"]
    # Deleted on A (which holds it): B's copy is gone too.
    assert a.delete("/v1/sessions/brief").status_code == 200
    assert b.get("/v1/sessions/brief").status_code == 404


def test_a_response_stored_by_one_worker_is_found_by_the_other(
    server: Server, workers: tuple[httpx.Client, httpx.Client],
) -> None:
    a, b = workers
    r1 = a.post("/v1/responses", json={"model": "m", "input": "First",
                                       "max_output_tokens": 2})
    assert r1.status_code == 200, r1.text
    first = r1.json()["id"]
    r2 = b.post("/v1/responses", json={"model": "m", "input": "Second",
                                       "previous_response_id": first,
                                       "max_output_tokens": 2})
    assert r2.status_code == 200, r2.text
    assert user_texts(sent(server)[-1]) == ["First", "Second"]
    second = r2.json()["id"]
    # Streamed on A at once, continuing B's: the record was written before the answer ended.
    with a.stream("POST", "/v1/responses", json={
            "model": "m", "input": "Third", "previous_response_id": second,
            "max_output_tokens": 2, "stream": True}) as r3:
        assert r3.status_code == 200
        events = [orjson.loads(line[6:]) for line in r3.iter_lines()
                  if line.startswith("data: ")]
    assert events[-1]["type"] == "response.incomplete"  # max_output_tokens ran out: kept too
    third = events[-1]["response"]["id"]
    assert user_texts(sent(server)[-1]) == ["First", "Second", "Third"]
    got = b.get(f"/v1/responses/{third}")
    assert got.status_code == 200, got.text
    assert got.json()["previous_response_id"] == second
    # Forgotten on B: not found on A.
    assert b.delete(f"/v1/responses/{first}").status_code == 200
    missing = a.get(f"/v1/responses/{first}")
    assert missing.status_code == 404, missing.text
    assert a.get(f"/v1/responses/{second}").status_code == 200
