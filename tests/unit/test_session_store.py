"""Server-side chat sessions (front/chat/sessions/store.py): splicing, bounds, TTL, ownership,
persistence."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from modelyard import db
from modelyard.errors import Conflict, InvalidRequest, SessionNotFound
from modelyard.front.chat.sessions.answer import Answer, SseAnswer, turn_stats
from modelyard.front.chat.sessions.relay import tap_sse
from modelyard.front.chat.sessions.store import (
    ChatSession,
    SessionStore,
    owner_of,
    requested_session_id,
    session_body,
    splice,
    valid_session_id,
)
from modelyard.front.identity.principal import ANONYMOUS_ADMIN, ANONYMOUS_INFERENCE, Principal

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

SYS = {"role": "system", "content": "Be brief."}
U1 = {"role": "user", "content": "Hi"}
A1 = {"role": "assistant", "content": "Hello!"}
U2 = {"role": "user", "content": "How are you?"}


def user(name: str, admin: bool = False) -> Principal:
    scopes = frozenset({"inference", "admin"} if admin else {"inference"})
    return Principal(name, admin, scopes, "token")


ALICE, BOB, ROOT = user("alice"), user("bob"), user("root", admin=True)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def answer(text: str, **payload: Any) -> Answer:
    a = Answer()
    a.absorb({"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                           "finish_reason": "stop"}], **payload})
    a.done = True
    return a


def turn(store: SessionStore, owner: str, sid: str, *messages: dict[str, Any],
         reply: str = "ok", model: str = "m", **payload: Any) -> ChatSession:
    t = store.begin(owner, sid, model, {"model": model, "messages": list(messages),
                                        "session_id": sid})
    assert t.commit(answer(reply, **payload))
    found = store.get(owner, sid)
    assert found is not None
    return found


# ---- ids -----------------------------------------------------------------------------------


@pytest.mark.parametrize("sid", ["a", "chat-1", "user:42.x_y", "Z" * 128])
def test_valid_ids(sid: str) -> None:
    assert valid_session_id(sid) == sid


@pytest.mark.parametrize("sid", ["", "a b", "../x", "é", "Z" * 129, 7, None])
def test_invalid_ids_name_the_field(sid: object) -> None:
    with pytest.raises(InvalidRequest) as err:
        valid_session_id(sid)
    assert err.value.param == "session_id"


def test_header_or_field_and_the_field_wins_only_when_they_agree() -> None:
    assert requested_session_id(None, {}) is None
    assert requested_session_id("h1", {}) == "h1"
    assert requested_session_id(None, {"session_id": "b1"}) == "b1"
    assert requested_session_id("same", {"session_id": "same"}) == "same"
    with pytest.raises(InvalidRequest) as err:
        requested_session_id("h1", {"session_id": "b1"})
    assert err.value.param == "session_id"


def test_anonymous_callers_share_one_owner() -> None:
    assert owner_of(ANONYMOUS_INFERENCE) == owner_of(ANONYMOUS_ADMIN) == ""
    assert owner_of(ALICE) == "alice"


# ---- splicing --------------------------------------------------------------------------------


def test_new_messages_are_appended_to_the_history() -> None:
    assert splice([SYS, U1, A1], [U2]) == [SYS, U1, A1, U2]
    assert splice([], [SYS, U1]) == [SYS, U1]


def test_a_resent_history_is_not_duplicated() -> None:
    assert splice([SYS, U1, A1], [SYS, U1, A1, U2]) == [SYS, U1, A1, U2]
    # Clients drop nulls and ids, and may send null content for ""; still the same messages.
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    stored = [U1, {"role": "assistant", "content": None, "tool_calls": [call]},
              {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    ollama_style = [U1, {"role": "assistant", "content": "",
                         "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
                    {"role": "tool", "content": "42"}, U2]
    assert splice(stored, ollama_style) == ollama_style


def test_a_system_message_in_the_request_replaces_the_stored_one() -> None:
    new_sys = {"role": "system", "content": "Be verbose."}
    assert splice([SYS, U1, A1], [new_sys, U2]) == [new_sys, U1, A1, U2]
    assert splice([U1, A1], [new_sys, U2]) == [new_sys, U1, A1, U2]


def test_session_body_never_sends_the_session_id_upstream() -> None:
    session = ChatSession("s", "alice", "m", messages=[U1, A1])
    body = session_body(session, {"model": "m", "session_id": "s", "messages": [U2],
                                  "temperature": 0.5})
    assert body == {"model": "m", "messages": [U1, A1, U2], "temperature": 0.5}


# ---- answers ---------------------------------------------------------------------------------


def test_a_streamed_answer_is_rebuilt_with_its_tool_calls() -> None:
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": '{"city": '}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": '"Paris"}'}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
         "timings": {"cache_n": 12, "prompt_n": 3, "predicted_n": 9}},
    ]
    raw = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
    raw += b"data: [DONE]\n\n"
    a = SseAnswer()
    for i in range(0, len(raw), 7):  # lines cut anywhere
        a.feed(raw[i:i + 7])
    assert a.ok
    assert a.message() == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]}
    stats = a.stats(5.0)
    assert stats is not None
    assert (stats.cached_tokens, stats.prompt_tokens, stats.completion_tokens) == (12, 15, 9)


def test_an_in_band_error_fails_the_answer() -> None:
    a = SseAnswer()
    a.feed(b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n')
    a.feed(b'data: {"error": {"code": "upstream_error", "message": "broke"}}\n\n')
    a.done = True
    assert not a.ok


def test_openai_cached_tokens_are_read() -> None:
    stats = turn_stats({"usage": {"prompt_tokens": 30, "completion_tokens": 2,
                                  "prompt_tokens_details": {"cached_tokens": 24}}}, 1.0)
    assert stats is not None and (stats.prompt_tokens, stats.cached_tokens) == (30, 24)
    assert turn_stats({"choices": []}, 1.0) is None


# ---- the store -------------------------------------------------------------------------------


def test_two_turns_keep_the_whole_conversation_and_the_cache_stats() -> None:
    store = SessionStore(clock=Clock())
    turn(store, "alice", "s", SYS, U1, reply="Hello!",
         usage={"prompt_tokens": 5, "completion_tokens": 1})
    t = store.begin("alice", "s", "m", {"model": "m", "messages": [U2]})
    assert t.body["messages"] == [SYS, U1, A1, U2]
    assert t.commit(answer("Fine.", usage={"prompt_tokens": 9, "completion_tokens": 1,
                                            "prompt_tokens_details": {"cached_tokens": 6}}))
    assert not t.commit(answer("again"))  # once only
    session = store.get("alice", "s")
    assert session is not None
    assert session.messages == [SYS, U1, A1, U2, {"role": "assistant", "content": "Fine."}]
    assert session.turns == 2 and session.cache_hits == 1 and session.cached_tokens_total == 6
    assert session.tokens == 10
    view = session.view(with_messages=True)
    assert view["cache"]["hits"] == 1 and view["messages"][-1]["content"] == "Fine."


def test_a_failed_turn_stores_nothing() -> None:
    store = SessionStore(clock=Clock())
    turn(store, "alice", "s", U1, reply="Hello!")
    t = store.begin("alice", "s", "m", {"model": "m", "messages": [U2]})
    failed = SseAnswer()
    failed.feed(b'data: {"error": {"message": "x"}}\n\n')
    failed.done = True
    assert not t.commit(failed)
    unfinished = Answer()  # a stream the client left: never done
    assert not t.commit(unfinished)
    session = store.get("alice", "s")
    assert session is not None and session.messages == [U1, A1] and session.turns == 1
    # A first turn that fails leaves no session at all.
    store.begin("alice", "new", "m", {"model": "m", "messages": [U1]}).commit(unfinished)
    assert store.get("alice", "new") is None


def test_another_model_is_a_conflict() -> None:
    store = SessionStore(clock=Clock())
    turn(store, "alice", "s", U1)
    with pytest.raises(Conflict) as err:
        store.begin("alice", "s", "other", {"model": "other", "messages": [U2]})
    assert err.value.param == "model" and err.value.status == 409


def test_lru_eviction_by_count() -> None:
    clock = Clock()
    store = SessionStore(max_count=3, clock=clock)
    for sid in ("a", "b", "c"):
        clock.now += 1
        turn(store, "alice", sid, U1)
    clock.now += 1
    turn(store, "alice", "a", U2)  # a is now the most recently used
    clock.now += 1
    turn(store, "alice", "d", U1)
    assert {s.id for s in store.list_for(ALICE)} == {"a", "c", "d"}  # b was the LRU
    assert store.evicted["count"] == 1
    assert [s.id for s in store.list_for(ALICE)] == ["d", "a", "c"]  # most recent first


def test_lru_eviction_by_total_bytes() -> None:
    big = {"role": "user", "content": "x" * 1000}
    store = SessionStore(max_total_bytes=2500, clock=Clock())
    turn(store, "alice", "a", big)
    turn(store, "alice", "b", big)
    assert len(store) == 2
    turn(store, "bob", "c", big)  # over 2500 in all: the least recently used goes
    assert store.get("alice", "a") is None
    assert store.get("alice", "b") is not None and store.get("bob", "c") is not None
    assert store.total_bytes <= 2500 and store.evicted["bytes"] == 1


def test_one_session_over_its_bound_loses_its_oldest_turns() -> None:
    store = SessionStore(max_bytes=400, clock=Clock())
    for i in range(10):
        question = {"role": "user", "content": f"question {i}"}
        messages = [SYS, question] if i == 0 else [question]
        session = turn(store, "alice", "s", *messages, reply=f"answer {i} " + "y" * 40)
    assert session.size_bytes <= 400
    assert session.messages[0] == SYS  # the system prompt stays
    assert session.messages[1]["role"] == "user"  # whole turns are dropped
    assert session.messages[-1]["content"].startswith("answer 9")
    assert session.trimmed_messages > 0 and session.trimmed_messages % 2 == 0
    # A single turn larger than the bound drops the session.
    turn_t = store.begin("alice", "huge", "m",
                         {"model": "m", "messages": [{"role": "user", "content": "z" * 500}]})
    turn_t.commit(answer("no"))
    assert store.get("alice", "huge") is None and store.evicted["size"] == 1


def test_ttl_expiry_on_access_and_by_sweep() -> None:
    clock = Clock()
    store = SessionStore(ttl_s=60.0, clock=clock)
    turn(store, "alice", "a", U1)
    clock.now += 30
    turn(store, "alice", "b", U1)
    clock.now += 31  # a idle 61 s, b 31 s
    assert store.get("alice", "a") is None
    assert store.get("alice", "b") is not None
    clock.now += 30
    assert store.sweep() == 1 and len(store) == 0
    assert store.evicted["ttl"] == 2
    # Using a session keeps it alive.
    turn(store, "alice", "c", U1)
    for _ in range(5):
        clock.now += 50
        turn(store, "alice", "c", U2)
    assert store.get("alice", "c") is not None


def test_another_owner_does_not_find_it_and_admins_do() -> None:
    store = SessionStore(clock=Clock())
    turn(store, "alice", "s", U1)
    turn(store, "bob", "t", U1)
    assert store.find(ALICE, "s").owner == "alice"
    with pytest.raises(SessionNotFound) as err:
        store.find(BOB, "s")
    assert err.value.status == 404 and err.value.code == "session_not_found"
    with pytest.raises(SessionNotFound):
        store.delete(BOB, "s")
    assert [s.id for s in store.list_for(BOB)] == ["t"]
    assert {s.id for s in store.list_for(ROOT)} == {"s", "t"}
    assert store.find(ROOT, "s").owner == "alice"  # the only one with that id
    assert store.find(ROOT, "t", owner="bob").owner == "bob"
    # The same id under two owners: two sessions.
    turn(store, "bob", "s", U2)
    assert store.find(ALICE, "s").messages[0] == U1
    assert store.find(BOB, "s").messages[0] == U2
    with pytest.raises(SessionNotFound):
        store.find(ROOT, "s")  # ambiguous without ?owner=
    assert store.delete_all(BOB) == 2
    assert [s.id for s in store.list_for(ROOT)] == ["s"]
    store.delete(ALICE, "s")
    assert len(store) == 0


def test_persistence_round_trip(database_url: str) -> None:
    url = database_url

    async def first() -> None:
        store = SessionStore(database=db.connect(url), clock=clock)
        await store.start()
        turn(store, "alice", "s", SYS, U1, reply="Hello!",
             usage={"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 3}})
        turn(store, "", "anon", U1)
        turn(store, "bob", "gone", U1)
        store.delete(BOB, "gone")
        await store.stop()  # flushes

    async def second() -> SessionStore:
        store = SessionStore(database=db.connect(url), clock=clock)
        await store.start()
        await store.stop()
        return store

    clock = Clock()
    asyncio.run(first())
    store = asyncio.run(second())
    session = store.get("alice", "s")
    assert session is not None
    assert session.messages == [SYS, U1, A1] and session.turns == 1
    assert session.cache_hits == 1 and session.cached_tokens_total == 3
    assert store.get("", "anon") is not None and store.get("bob", "gone") is None
    assert session.size_bytes > 0 and store.total_bytes >= session.size_bytes
    clock.now += 10_000  # past the TTL: expired sessions are not reloaded (and deleted)
    assert len(asyncio.run(second())) == 0


def test_a_stream_commits_before_the_client_sees_done() -> None:
    """A client that sends its next turn as soon as it reads [DONE] finds this one stored."""
    store = SessionStore(clock=Clock())
    t = store.begin("alice", "s", "m", {"model": "m", "messages": [U1]})
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"Hello!"}}]}\n\n'
    done = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'

    async def upstream() -> Any:
        yield chunk
        yield done
        yield b""  # the end of the body arrives later

    async def client() -> None:
        async for got in tap_sse(t, upstream()):
            if b"[DONE]" in got:
                stored = store.get("alice", "s")
                assert stored is not None and stored.messages == [U1, A1]
                return
        raise AssertionError("no [DONE]")

    asyncio.run(client())


@pytest.mark.postgres
def test_two_fronts_on_one_database_continue_each_others_sessions(postgres_server: Any) -> None:
    """Several fronts (a shared, non-SQLite database): B continues a session A made, and A's
    stale copy, written again later, does not overwrite B's newer turn."""
    url = postgres_server.create_database("sessions_shared")
    clock = Clock()

    async def run() -> None:
        a = SessionStore(database=db.connect(url), clock=clock)
        b = SessionStore(database=db.connect(url), clock=clock)
        await a.start()
        await b.start()
        assert a.shared and b.shared
        turn(a, "alice", "s", U1, reply="Hello!")
        await a.flush()
        await b.refresh("alice", "s")  # made on A: B loads it
        clock.now += 1
        t = b.begin("alice", "s", "m", {"model": "m", "messages": [U2]})
        assert t.body["messages"] == [U1, A1, U2]
        assert t.commit(answer("Fine."))
        await b.flush()
        stale = a.get("alice", "s")
        assert stale is not None and stale.turns == 1
        a.changed(stale)  # A writes its old copy again (e.g. a KV note): B's row stays
        await a.flush()
        await a.refresh("alice", "s")
        fresh = a.get("alice", "s")
        assert fresh is not None and fresh.turns == 2
        assert fresh.messages[-1] == {"role": "assistant", "content": "Fine."}
        await a.stop()
        await b.stop()

    asyncio.run(run())


def test_a_sqlite_store_is_one_fronts_and_never_reads_back(tmp_path: Any) -> None:
    """On SQLite nothing is read per turn (one front; the hot path pays no query)."""
    store = SessionStore(database=db.connect(f"sqlite:///{tmp_path / 'm.db'}"))
    assert not store.shared
