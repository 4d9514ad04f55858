"""Server-side chat sessions through real `modelyard serve` processes and the fake backend, which
shows what it was sent (GET /requests): a turn sends only its new message and the backend gets
the whole conversation; OpenAI and Ollama, streamed and not; list/get/delete; another owner's
404; persistence across a restart; eviction by count and by TTL."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import openai
import pytest
from tests.integration.harness import (
    TEXT_3,
    config,
    model_status,
    module_server,
    stream_events,
)
from tests.support import Server, fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SYS = {"role": "system", "content": "Be brief."}
U1 = {"role": "user", "content": "Hi there"}
U2 = {"role": "user", "content": "And then?"}
A3 = {"role": "assistant", "content": TEXT_3}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = config(fake_model("m"), fake_model("other"),
                 fake_model("crashy", "--crash-after-tokens", "2"))
    with module_server(tmp_path_factory, cfg, "--single-process") as s:
        yield s


def sent_to_backend(server: Server, model: str) -> list[dict[str, Any]]:
    found = model_status(server, model)
    assert found is not None and found["upstream"]
    return list(httpx.get(found["upstream"] + "/requests", timeout=10).json())


def openai_turn(server: Server, body: dict[str, Any], headers: dict[str, str] | None = None,
                ) -> tuple[httpx.Response, str]:
    """The response and the answer's text (streamed or not)."""
    body = {"model": "m", "max_tokens": 3, **body}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers=headers, timeout=30) as r:
        raw = r.read().decode()
    if r.status_code != 200:
        return r, raw
    if not body.get("stream"):
        return r, str(json.loads(raw)["choices"][0]["message"]["content"])
    events = stream_events("openai", raw)
    if events[-1] != "[DONE]":  # an in-band error
        return r, raw
    text = "".join((e["choices"][0]["delta"].get("content") or "") for e in events
                   if isinstance(e, dict) and e.get("choices"))
    return r, text


def ollama_turn(server: Server, body: dict[str, Any]) -> tuple[httpx.Response, str]:
    body = {"model": "m", "options": {"num_predict": 3}, **body}
    r = httpx.post(server.url + "/api/chat", json=body, timeout=30)
    if r.status_code != 200:
        return r, r.text
    if body.get("stream", True):
        events = stream_events("ollama", r.text)
        assert events[-1]["done"] is True
        return r, "".join(e["message"]["content"] for e in events)
    return r, str(r.json()["message"]["content"])


def get_session(server: Server, sid: str, headers: dict[str, str] | None = None
                ) -> httpx.Response:
    return httpx.get(f"{server.url}/v1/sessions/{sid}", headers=headers, timeout=10)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_second_turn_sends_only_the_new_message(server: Server, stream: bool) -> None:
    sid = f"openai-{stream}"
    r, text = openai_turn(server, {"messages": [SYS, U1], "session_id": sid, "stream": stream})
    assert r.status_code == 200 and text == TEXT_3
    assert r.headers["x-session-id"] == sid
    # The second turn names the session by header and sends only its new message.
    r, text = openai_turn(server, {"messages": [U2], "stream": stream},
                          headers={"X-Session-Id": sid})
    assert r.status_code == 200 and text == TEXT_3
    last = sent_to_backend(server, "m")[-1]
    assert last["messages"] == [SYS, U1, A3, U2]
    assert "session_id" not in last
    got = get_session(server, sid)
    assert got.status_code == 200, got.text
    view = got.json()
    assert view["messages"] == [SYS, U1, A3, U2, A3]
    assert view["turns"] == 2 and view["model"] == "m" and view["size_bytes"] > 0
    assert len(view["cache"]["turns"]) == 2  # the fake reports cache_n (0) every turn
    # A client that resends the whole conversation does not duplicate it.
    r, _ = openai_turn(server, {"messages": [*view["messages"], U1], "session_id": sid})
    assert r.status_code == 200
    assert sent_to_backend(server, "m")[-1]["messages"] == [SYS, U1, A3, U2, A3, U1]


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_chat_keeps_the_session(server: Server, stream: bool) -> None:
    sid = f"ollama-{stream}"
    r, text = ollama_turn(server, {"messages": [U1], "session_id": sid, "stream": stream})
    assert r.status_code == 200 and text == TEXT_3
    assert r.headers["x-session-id"] == sid
    r, text = ollama_turn(server, {"messages": [U2], "session_id": sid, "stream": stream})
    assert r.status_code == 200 and text == TEXT_3
    last = sent_to_backend(server, "m")[-1]
    assert [(m["role"], m["content"]) for m in last["messages"]] == [
        ("user", U1["content"]), ("assistant", TEXT_3), ("user", U2["content"])]
    assert "session_id" not in last
    assert get_session(server, sid).json()["turns"] == 2


@pytest.mark.parametrize("stream", [False, True])
def test_native_chat_keeps_the_session(server: Server, stream: bool) -> None:
    sid = f"native-{stream}"
    for message in (U1, U2):
        body = {"model": "m", "messages": [message], "max_tokens": 3, "stream": stream}
        r = httpx.post(server.url + "/chat", json=body, headers={"X-Session-Id": sid},
                       timeout=30)
        assert r.status_code == 200 and r.headers["x-session-id"] == sid
        if stream:
            assert '"done":true' in r.text.replace(" ", "")
    assert sent_to_backend(server, "m")[-1]["messages"] == [U1, A3, U2]
    assert get_session(server, sid).json()["messages"] == [U1, A3, U2, A3]


def test_the_official_clients_use_sessions(server: Server) -> None:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=30)
    oai.chat.completions.create(model="m", messages=[U1], max_tokens=3,  # type: ignore[list-item]
                                extra_body={"session_id": "sdk"})
    raw = oai.chat.completions.with_raw_response.create(
        model="m", messages=[U2], max_tokens=3,  # type: ignore[list-item]
        extra_headers={"X-Session-Id": "sdk"})
    assert raw.headers["x-session-id"] == "sdk"
    assert raw.parse().choices[0].message.content == TEXT_3
    assert sent_to_backend(server, "m")[-1]["messages"] == [U1, A3, U2]
    client = ollama.Client(host=server.url, headers={"X-Session-Id": "sdk-ollama"})
    for message in (U1, U2):
        reply = client.chat(model="m", messages=[message], options={"num_predict": 3})
        assert reply["message"]["content"] == TEXT_3
    assert [m["content"] for m in sent_to_backend(server, "m")[-1]["messages"]] == [
        U1["content"], TEXT_3, U2["content"]]


def test_the_session_id_is_checked(server: Server) -> None:
    r, raw = openai_turn(server, {"messages": [U1], "session_id": "a"},
                         headers={"X-Session-Id": "b"})
    assert r.status_code == 400
    assert json.loads(raw)["error"]["param"] == "session_id"
    r, raw = openai_turn(server, {"messages": [U1], "session_id": "no spaces"})
    assert r.status_code == 400 and json.loads(raw)["error"]["code"] == "invalid_request"
    r = httpx.post(server.url + "/v1/completions", json={
        "model": "m", "prompt": "x", "session_id": "c"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"
    # Not a chat: the header is ignored (a client may send it on every call).
    r = httpx.post(server.url + "/v1/completions", json={"model": "m", "prompt": "x",
                                                         "max_tokens": 2},
                   headers={"X-Session-Id": "c"}, timeout=30)
    assert r.status_code == 200 and "x-session-id" not in r.headers
    assert "session_id" not in sent_to_backend(server, "m")[-1]
    assert get_session(server, "a").status_code == 404
    assert get_session(server, "c").status_code == 404


def test_another_model_in_a_session_is_a_conflict(server: Server) -> None:
    r, _ = openai_turn(server, {"messages": [U1], "session_id": "conflict"})
    assert r.status_code == 200
    r, raw = openai_turn(server, {"model": "other", "messages": [U2], "session_id": "conflict"})
    assert r.status_code == 409, raw
    assert json.loads(raw)["error"]["param"] == "model"
    assert get_session(server, "conflict").json()["turns"] == 1


def test_a_failed_turn_stores_nothing(server: Server) -> None:
    body = {"model": "crashy", "messages": [U1], "session_id": "crash", "stream": True}
    r, raw = openai_turn(server, body)
    assert r.status_code == 200 and "upstream_error" in raw  # in-band, after the first bytes
    r = get_session(server, "crash")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


def test_list_get_and_delete(server: Server) -> None:
    for sid in ("keep-1", "keep-2", "drop"):
        assert openai_turn(server, {"messages": [U1], "session_id": sid})[0].status_code == 200
    listed = httpx.get(server.url + "/v1/sessions", timeout=10).json()
    ids = [s["id"] for s in listed["data"]]
    assert {"keep-1", "keep-2", "drop"} <= set(ids)
    assert ids.index("drop") < ids.index("keep-1")  # most recently used first
    assert "messages" not in listed["data"][0]
    r = httpx.delete(server.url + "/v1/sessions/drop", timeout=10)
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert get_session(server, "drop").status_code == 404
    assert httpx.delete(server.url + "/v1/sessions/drop", timeout=10).status_code == 404
    r = httpx.delete(server.url + "/v1/sessions", timeout=10)
    assert r.status_code == 200 and r.json()["deleted"] >= 2
    assert httpx.get(server.url + "/v1/sessions", timeout=10).json()["data"] == []


# ---- owners --------------------------------------------------------------------------------


def test_another_owner_gets_404(start_server: Any) -> None:
    server = start_server(config(fake_model("m"), auth="required"), "--single-process")
    admin = httpx.Client(base_url=server.url, headers=server.admin_headers, timeout=30)
    bearer = {}
    for name in ("carol", "dave"):
        r = admin.post("/admin/users", json={"name": name, "password": f"{name}-pw-123",
                                              "must_change_password": False})
        assert r.status_code in (200, 201), r.text
        r = admin.post("/tokens", json={"name": f"{name}-t", "owner": name})
        assert r.status_code in (200, 201), r.text
        bearer[name] = {"Authorization": f"Bearer {r.json()['token']}"}
    r, _ = openai_turn(server, {"messages": [U1], "session_id": "mine"}, headers=bearer["carol"])
    assert r.status_code == 200
    assert get_session(server, "mine", bearer["carol"]).status_code == 200
    r = get_session(server, "mine", bearer["dave"])
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    r = httpx.delete(server.url + "/v1/sessions/mine", headers=bearer["dave"], timeout=10)
    assert r.status_code == 404
    assert httpx.get(server.url + "/v1/sessions", headers=bearer["dave"],
                     timeout=10).json()["data"] == []
    # dave's session of the same name is his own: carol's history is not in it.
    r, _ = openai_turn(server, {"messages": [U2], "session_id": "mine"}, headers=bearer["dave"])
    assert r.status_code == 200
    assert get_session(server, "mine", bearer["dave"]).json()["messages"][0] == U2
    assert get_session(server, "mine", bearer["carol"]).json()["messages"][0] == U1
    # Admins see every session, and name the owner when the id is not unique.
    listed = admin.get("/v1/sessions").json()["data"]
    assert sorted(s["owner"] for s in listed) == ["carol", "dave"]
    assert admin.get("/v1/sessions/mine?owner=carol").json()["owner"] == "carol"
    # Without credentials: 401, as every inference route in auth `required`.
    assert get_session(server, "mine").status_code == 401


# ---- persistence and bounds ----------------------------------------------------------------


def test_sessions_survive_a_restart_when_persisted(start_server: Any) -> None:
    cfg = config(fake_model("m"), chat_session_persist=True)
    first = start_server(cfg, "--single-process")
    assert openai_turn(first, {"messages": [SYS, U1], "session_id": "kept"})[0].status_code == 200
    first.stop()  # SIGTERM: sessions are flushed on the way down
    second = Server(first.home, cfg, "--single-process")
    try:
        second.wait_healthy()
        view = get_session(second, "kept").json()
        assert view["messages"] == [SYS, U1, A3] and view["turns"] == 1
        r, _ = openai_turn(second, {"messages": [U2], "session_id": "kept"})
        assert r.status_code == 200
        assert sent_to_backend(second, "m")[-1]["messages"] == [SYS, U1, A3, U2]
    finally:
        second.stop()


def test_eviction_by_count_and_by_ttl(start_server: Any) -> None:
    server = start_server(config(fake_model("m"), chat_session_max_count=2,
                                 chat_session_ttl_s=3.0, chat_session_sweep_interval_s=0.2),
                          "--single-process")
    for sid in ("s1", "s2", "s3"):
        assert openai_turn(server, {"messages": [U1], "session_id": sid})[0].status_code == 200
    assert get_session(server, "s1").status_code == 404  # the least recently used went
    assert get_session(server, "s3").status_code == 200
    overview = httpx.get(server.url + "/v1/status", timeout=10).json()["chat_sessions"]
    assert overview["count"] == 2 and overview["evicted"]["count"] == 1
    # Idle past the TTL, the others expire: the sweeper takes them (/status does not sweep).
    poll(lambda: httpx.get(server.url + "/status", timeout=10).json()["chat_sessions"]["count"]
         == 0, timeout_s=20, what="the sweeper to expire the sessions")
    assert get_session(server, "s3").status_code == 404
    assert httpx.get(server.url + "/v1/sessions", timeout=10).json()["data"] == []
