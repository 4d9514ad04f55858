"""How the chat APIs use server-side sessions (front/chat/sessions/store.py) on their way to a
backend.

A request without a session (no `session_id` field, no `X-Session-Id` header) never gets here
past `session_id_for`, which only looks: its bytes go upstream unchanged. A session turn's
upstream body is `Turn.body` (the history spliced with the new messages, plus the backend's KV
hints: front/chat/sessions/kv.py); the answer is read as it
passes, and the turn is committed before the client sees the end of the answer (the `[DONE]` event,
Ollama's `done` message, or the whole body), so a client that sends its next turn at once finds
this one stored.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import orjson
from starlette.responses import Response

from modelyard.errors import InvalidRequest
from modelyard.front.chat.sessions.answer import Answer, SseAnswer
from modelyard.front.chat.sessions.kv import session_key
from modelyard.front.chat.sessions.store import (
    BODY_FIELD,
    RESPONSE_HEADER,
    Turn,
    owner_of,
    requested_session_id,
)

if TYPE_CHECKING:
    from modelyard.front.request_context import RequestContext


def session_id_for(header: str | None, data: dict[str, Any], *, chat: bool = True
                   ) -> str | None:
    """The session a request names (`header`: its X-Session-Id, None: not sent; `data`: its
    own fields), validated; None (the common case) when it names none. Not a chat (`chat`
    false): the `session_id` field is a 400 (it would go upstream), the header is ignored (a
    client may send it on every call). The API layer asks once (front/request_context.py)."""
    if header is None and BODY_FIELD not in data:
        return None
    if not chat:
        if BODY_FIELD in data:
            raise InvalidRequest(f"{BODY_FIELD}: sessions are for chats (/v1/chat/completions, "
                                 "/api/chat)", param=BODY_FIELD)
        return None
    return requested_session_id(header, data)


async def refresh_session(ctx: RequestContext, session_id: str) -> None:
    """Before a turn: the caller's session as the database has it when another front
    answered since (several fronts on one database; nothing to do otherwise)."""
    await ctx.state.chat.sessions.refresh(owner_of(ctx.principal), session_id)


def begin_turn(ctx: RequestContext, session_id: str, model: str, body: dict[str, Any], *,
               kv_hints: bool = True) -> Turn:
    """The turn `body` (an OpenAI chat request) starts in the caller's session `session_id`;
    `kv_hints` False: a body for several upstream requests (a tool loop's rounds), which the
    per-turn slot restore and save do not fit."""
    state = ctx.state
    entry = state.catalog.registry.get(model)
    canonical = entry.name if entry is not None else model  # aliases name one model
    owner = owner_of(ctx.principal)
    turn = state.chat.sessions.begin(owner, session_id, canonical, body)
    if kv_hints and entry is not None:
        turn.body, turn.kv = state.chat.session_kv.plan(
            entry.spec, session_key(owner, session_id), turn.body)
    return turn


def tap_sse(turn: Turn, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An OpenAI SSE stream passed on unchanged; the turn commits as `[DONE]` goes by (or at the
    end of a stream that finished without it)."""

    async def tapped() -> AsyncIterator[bytes]:
        answer = SseAnswer()
        async for chunk in chunks:
            answer.feed(chunk)
            if answer.done:
                turn.commit(answer)  # before the client can see [DONE] and send its next turn
            yield chunk
        answer.feed(b"\n")
        answer.done = answer.done or answer.finish_reason is not None
        turn.commit(answer)

    return tapped()


def tap_translated(
    turn: Turn, absorb: Callable[[dict[str, Any]], str], on_done: Callable[[], bytes]
) -> tuple[Callable[[dict[str, Any]], str], Callable[[], bytes]]:
    """For a stream translated to another API (front/dispatch/relay.py `translated_stream`):
    `absorb` that also reads the answer, and `on_done` that commits the turn before the closing
    message is made."""
    answer = Answer()

    def both(payload: dict[str, Any]) -> str:
        answer.absorb(payload)
        return absorb(payload)

    def done() -> bytes:
        answer.done = True
        turn.commit(answer)
        return on_done()

    return both, done


def commit_body(turn: Turn, body: bytes | dict[str, Any]) -> None:
    """A whole (status 200) OpenAI answer, as bytes or parsed."""
    if isinstance(body, bytes):
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
    else:
        payload = body
    if not isinstance(payload, dict):
        return
    answer = Answer()
    answer.absorb(payload)
    answer.done = True
    turn.commit(answer)


def settled(turn: Turn, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A shared store's turn (several workers or fronts: store.py): each chunk that follows the
    turn's commit (or a change of it, a stored response kept) waits until the database has it,
    so the client cannot see the end of the answer before another process could read it."""
    store, owner, sid = turn.store, turn.session.owner, turn.session.id

    async def after_writes() -> AsyncIterator[bytes]:
        async for chunk in chunks:
            if store.pending(owner, sid):
                await store.settle(owner, sid)
            yield chunk

    return after_writes()


async def settle(turn: Turn) -> None:
    """A whole answer's turn: in the database (shared store) before the answer is sent."""
    await turn.store.settle(turn.session.owner, turn.session.id)


def tagged(response: Response, turn: Turn | None) -> Response:
    if turn is not None:
        response.headers[RESPONSE_HEADER] = turn.session.id
    return response
