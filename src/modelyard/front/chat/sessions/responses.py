"""Stored OpenAI Responses (`store`, `previous_response_id`) on top of the server-side chat
sessions (front/chat/sessions/store.py): a stored response is a session turn.

A response that starts a conversation opens a session named after it (its id, `resp_…`); the
Response object is kept in that session's `extra["responses"]` with `upto`, the position of its
answer in the history (counted with the messages the session trimmed, so it survives a trim).
A response continuing the session's latest one (`previous_response_id` = the head) is one more
turn of the same session: only the new input is sent by the client, the history is spliced in
by the session, and its KV cache is reused by the backend (front/chat/sessions/kv.py). One that
continues an older response (a fork), names another model (a session is bound to one), or
drops the previous `instructions` (OpenAI does not carry them over) starts a new session seeded
with the history up to that response.

Records live and die with their session: its bounds, TTL (`chat_session_ttl_s`), persistence
and ownership. Another owner's response is "not found" (404), like a missing one. Looking one up
scans the caller's sessions (at most `chat_session_max_count`): no second index to keep true.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modelyard.errors import ModelyardError
from modelyard.front.chat.sessions.splice import leading_system
from modelyard.front.chat.sessions.store import ChatSession, SessionStore, owner_of
from modelyard.front.identity.principal import Principal

RECORDS = "responses"  # session.extra key: {response id: record}
HEAD = "responses_head"  # session.extra key: the id of the latest response in the session


class ResponseNotFound(ModelyardError):
    status = 404
    code = "response_not_found"
    openai_type = "invalid_request_error"

    @classmethod
    def for_id(cls, resp_id: str, param: str | None = None) -> ResponseNotFound:
        return cls(f"no stored response {resp_id!r} (or it is not yours, was created with "
                   "store: false, or expired)", param=param)


@dataclass
class Continuation:
    """Where a response that continues another runs: `session_id` None is no session
    (store: false); `history` is what the client did not resend (empty: the session has it)."""

    session_id: str | None
    history: list[dict[str, Any]]


def find(store: SessionStore, principal: Principal, resp_id: str, param: str | None = None,
         ) -> tuple[ChatSession, dict[str, Any]]:
    """The caller's stored response: its session and record."""
    owner = owner_of(principal)
    for session in store.list_for(principal):
        if session.owner != owner:
            continue
        record = (session.extra.get(RECORDS) or {}).get(resp_id)
        if record is not None:
            return session, record
    raise ResponseNotFound.for_id(resp_id, param)


def history_at(session: ChatSession, record: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation up to and including the response's answer, without the response's own
    `instructions` (not carried over)."""
    end = int(record["upto"]) - session.trimmed_messages
    systems = leading_system(session.messages)
    messages = session.messages[:max(end, systems)]
    if record.get("instructions"):
        messages = messages[systems:]
    return list(messages)


def continuation(store: SessionStore, principal: Principal, prev_id: str, *, model: str,
                 instructions: bool, store_new: bool, new_id: str) -> Continuation:
    """How a response with `previous_response_id` = `prev_id` runs (see the module doc)."""
    session, record = find(store, principal, prev_id, "previous_response_id")
    in_place = (store_new and session.extra.get(HEAD) == prev_id and session.model == model
                and (instructions or not record.get("instructions")))
    if in_place:
        # Claimed: a concurrent continuation of the same response forks instead of racing this
        # one's commit (the last commit would win the history under both records). Recorded
        # again when this turn's answer commits; a failed turn leaves it unclaimed: a fork.
        session.extra[HEAD] = None
        return Continuation(session.id, [])
    return Continuation(new_id if store_new else None, history_at(session, record))


def record(store: SessionStore, owner: str, session_id: str, response: dict[str, Any], *,
           instructions: bool) -> bool:
    """Keep `response` as the latest turn of its session, just committed; False when the session
    did not keep the turn (it was over `chat_session_max_bytes` alone)."""
    session = store.get(owner, session_id)
    if session is None:
        return False
    records = session.extra.setdefault(RECORDS, {})
    records[response["id"]] = {"upto": session.trimmed_messages + len(session.messages),
                               "instructions": instructions, "response": response}
    session.extra[HEAD] = response["id"]
    store.changed(session)  # the record is persisted with its session
    return True


def delete(store: SessionStore, principal: Principal, resp_id: str) -> None:
    """Forget a stored response; its session goes with its last response."""
    session, _ = find(store, principal, resp_id)
    records = session.extra.get(RECORDS) or {}
    records.pop(resp_id, None)
    if session.extra.get(HEAD) == resp_id:
        session.extra[HEAD] = None
    if not records:
        store.delete(principal, session.id, session.owner)
    else:
        store.changed(session)
