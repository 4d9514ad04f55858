"""Stored OpenAI Responses on the chat sessions (front/chat/sessions/responses.py): where a
continuation runs (same session, a fork, none), the history up to a response after the session
trimmed its oldest turns, ownership, deleting, persistence."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from modelyard import db
from modelyard.front.chat.sessions import responses as stored
from modelyard.front.chat.sessions.answer import Answer
from modelyard.front.chat.sessions.store import SessionStore
from modelyard.front.identity.principal import Principal

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

ALICE = Principal("alice", False, frozenset({"inference"}), "token")
BOB = Principal("bob", False, frozenset({"inference"}), "token")


def msg(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "content": text}


def respond(store: SessionStore, sid: str, resp_id: str, *messages: dict[str, Any],
            reply: str = "ok", instructions: bool = False, model: str = "m") -> None:
    """One stored response: a committed turn of session `sid`, then its record."""
    turn = store.begin("alice", sid, model, {"model": model, "messages": list(messages)})
    answer = Answer()
    answer.absorb({"choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                "finish_reason": "stop"}]})
    answer.done = True
    assert turn.commit(answer)
    assert stored.record(store, "alice", sid, {"id": resp_id, "object": "response"},
                         instructions=instructions)


def test_continuing_the_latest_response_stays_in_its_session() -> None:
    store = SessionStore()
    respond(store, "resp_1", "resp_1", msg("user", "one"))
    cont = stored.continuation(store, ALICE, "resp_1", model="m", instructions=False,
                               store_new=True, new_id="resp_2")
    assert cont == stored.Continuation("resp_1", [])
    # A second continuation of the same response before the first one answered: a fork.
    again = stored.continuation(store, ALICE, "resp_1", model="m", instructions=False,
                                store_new=True, new_id="resp_3")
    assert again == stored.Continuation("resp_3", [msg("user", "one"), msg("assistant", "ok")])


@pytest.mark.parametrize(("model", "instructions", "store_new", "session"), [
    ("other", False, True, "resp_new"),  # a session is bound to its model
    ("m", False, False, None),  # store: false keeps nothing
])  # fmt: skip
def test_other_continuations_get_the_history(model: str, instructions: bool, store_new: bool,
                                             session: str | None) -> None:
    store = SessionStore()
    respond(store, "resp_1", "resp_1", msg("user", "one"))
    cont = stored.continuation(store, ALICE, "resp_1", model=model, instructions=instructions,
                               store_new=store_new, new_id="resp_new")
    assert cont == stored.Continuation(session, [msg("user", "one"), msg("assistant", "ok")])


def test_a_fork_from_an_older_response_gets_its_history_only() -> None:
    store = SessionStore()
    respond(store, "resp_1", "resp_1", msg("system", "rules"), msg("user", "one"),
            instructions=True)
    respond(store, "resp_1", "resp_2", msg("user", "two"), reply="second", instructions=True)
    cont = stored.continuation(store, ALICE, "resp_1", model="m", instructions=True,
                               store_new=True, new_id="resp_3")
    # Its own instructions are not carried over (the new request brings its own).
    assert cont == stored.Continuation("resp_3", [msg("user", "one"), msg("assistant", "ok")])
    # Continuing the latest without instructions: the earlier ones must go, so a new session.
    cont = stored.continuation(store, ALICE, "resp_2", model="m", instructions=False,
                               store_new=True, new_id="resp_4")
    assert cont.session_id == "resp_4"
    assert cont.history == [msg("user", "one"), msg("assistant", "ok"), msg("user", "two"),
                            msg("assistant", "second")]


def test_history_counts_the_turns_a_session_trimmed() -> None:
    store = SessionStore(max_bytes=300)
    respond(store, "s", "resp_1", msg("user", "a" * 60))
    respond(store, "s", "resp_2", msg("user", "b" * 60))
    respond(store, "s", "resp_3", msg("user", "c" * 60))
    session, record = stored.find(store, ALICE, "resp_2")
    assert session.trimmed_messages > 0  # the first turn went
    assert stored.history_at(session, record)[-2:] == [msg("user", "b" * 60),
                                                       msg("assistant", "ok")]


def test_another_owner_and_unknown_ids_are_not_found() -> None:
    store = SessionStore()
    respond(store, "resp_1", "resp_1", msg("user", "one"))
    for who, rid in ((BOB, "resp_1"), (ALICE, "resp_x")):
        with pytest.raises(stored.ResponseNotFound):
            stored.find(store, who, rid)
        with pytest.raises(stored.ResponseNotFound):
            stored.delete(store, who, rid)
    assert stored.find(store, ALICE, "resp_1")[1]["response"]["id"] == "resp_1"


def test_delete_drops_the_session_with_its_last_response() -> None:
    store = SessionStore()
    respond(store, "resp_1", "resp_1", msg("user", "one"))
    respond(store, "resp_1", "resp_2", msg("user", "two"))
    stored.delete(store, ALICE, "resp_2")
    assert store.get("alice", "resp_1") is not None
    # The head went: continuing resp_1 now forks rather than extending past resp_2's turn.
    assert stored.continuation(store, ALICE, "resp_1", model="m", instructions=False,
                               store_new=True, new_id="resp_3").session_id == "resp_3"
    stored.delete(store, ALICE, "resp_1")
    assert store.get("alice", "resp_1") is None


def test_records_are_persisted_with_their_session(database_url: str) -> None:
    url = database_url

    async def first() -> None:
        store = SessionStore(database=db.connect(url))
        await store.start()
        respond(store, "resp_1", "resp_1", msg("user", "one"))
        respond(store, "resp_1", "resp_2", msg("user", "two"))
        await store.flush()
        stored.delete(store, ALICE, "resp_1")  # not the session's last: only a record goes
        await store.stop()

    async def second() -> SessionStore:
        store = SessionStore(database=db.connect(url))
        await store.start()
        await store.stop()
        return store

    asyncio.run(first())
    store = asyncio.run(second())
    assert stored.find(store, ALICE, "resp_2")[1]["response"] == {"id": "resp_2",
                                                                   "object": "response"}
    with pytest.raises(stored.ResponseNotFound):
        stored.find(store, ALICE, "resp_1")
