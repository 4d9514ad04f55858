"""The hot lane: a plain OpenAI chat or embedding request answered without the web framework.

Most requests a front serves are the plainest of their kind: an OpenAI chat of text messages
and sampling fields, not streamed, in no session, with no tools, images or archive; an
embedding of text. For those, the regular route (Starlette's router, its Request and Response,
the pydantic schema, the chat pipeline's feature checks) costs more CPU than the relay itself
(issue 33's bench-front). The edge (front/api/edge.py) offers such a request here first, after
its caller and limits are decided; a request the lane does not recognise as plain goes on to
its route with the body already read, replayed, so it is answered exactly as before. A chat
to a preset that enables MCP servers (the tool loop) is not plain, whatever its body.

What the lane does is what the route does for the plain case, through the same parts: the
dispatcher's `open_relay` (queue, fair share, lease, the early send), the relay's `read` (usage
from the body, the lease released), a non-streamed chat's client watch (a client that leaves
stops the backend), the OpenAI error shapes (`openai_compat.openai_error` for llama-server's
context overflow, a backend's other errors passed through: the same functions the routes call),
the embedding model's kind check.
What makes a request plain is checked strictly and cheaply here (`plain_chat`,
`plain_embedding`); anything else — a wrong type included — goes the regular way, which checks
it fully and answers its 400 in the documented shape.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.types import Message, Receive, Scope, Send

from modelyard.front.api.embeddings import PATH as EMBEDDINGS_PATH
from modelyard.front.api.embeddings import upstream_path
from modelyard.front.api.model_kind import require_kind
from modelyard.front.archive.capture import HEADER as ARCHIVE_HEADER
from modelyard.front.chat.render import openai_upstream_error
from modelyard.front.chat.request import CHAT_PATH
from modelyard.front.chat.sessions.store import HEADER as SESSION_HEADER
from modelyard.front.chat.tools.loop import mcp_servers_of
from modelyard.front.dispatch.relay import ClientWatch, Relay, passthrough_error, watched
from modelyard.front.state import PRIORITY_HEADER, FrontState, priority_for
from modelyard.http_limits import CLIENT_GONE
from modelyard.wire.speculative import SPECULATIVE_HEADER

# A chat body with only these fields, of the types `plain_chat` checks, is plain: none of them
# asks the front for anything but the relay (no stream, n, tools, logprobs, session, archive,
# keep_alive, response_format: each of those goes the regular way).
_CHAT_FIELDS = frozenset(
    {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
     "stop", "seed", "stream", "user", "presence_penalty", "frequency_penalty"})  # fmt: skip
_ROLES = frozenset({"system", "developer", "user", "assistant"})
_MESSAGE_FIELDS = frozenset({"role", "content", "name"})
_EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "user"})
# The headers that take a request off the lane (a session, an archive plan) and the one it
# reads (its priority), lowercased as ASGI gives them.
_OFF_LANE = frozenset({SESSION_HEADER.lower().encode(), ARCHIVE_HEADER.lower().encode()})
_PRIORITY = PRIORITY_HEADER.lower().encode()
_JSON = [(b"content-type", b"application/json")]

Lane = Callable[[Scope, Receive, Send], Awaitable[Receive | None]]


def _number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)) and value >= 0


def plain_chat(data: Any) -> bool:
    """`data` is a chat the lane answers as the regular route would: text messages of known
    roles, sampling fields of their types, not streamed."""
    if not isinstance(data, dict) or not _CHAT_FIELDS.issuperset(data):
        return False
    model, messages = data.get("model"), data.get("messages")
    if not isinstance(model, str) or not model or not isinstance(messages, list) or not messages:
        return False
    for message in messages:
        if not isinstance(message, dict) or not _MESSAGE_FIELDS.issuperset(message) or \
                message.get("role") not in _ROLES or not isinstance(message.get("content"), str):
            return False
    if data.get("stream", False) is not False:
        return False
    for name in ("max_tokens", "max_completion_tokens", "seed"):
        value = data.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 0):  # fmt: skip
            return False
    temperature, top_p = data.get("temperature"), data.get("top_p")
    if temperature is not None and not _number(temperature):
        return False
    if top_p is not None and not (_number(top_p) and top_p <= 1):
        return False
    for name in ("presence_penalty", "frequency_penalty"):
        value = data.get(name)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
            return False
    stop, user = data.get("stop"), data.get("user")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):  # fmt: skip
        return False
    return user is None or isinstance(user, str)


def plain_embedding(data: Any) -> bool:
    """`data` is an embedding of text (a string or a list of them) in floats or base64."""
    if not isinstance(data, dict) or not _EMBEDDING_FIELDS.issuperset(data):
        return False
    model, texts = data.get("model"), data.get("input")
    if not isinstance(model, str) or not model:
        return False
    if isinstance(texts, str):
        if not texts:
            return False
    elif not (isinstance(texts, list) and texts and all(isinstance(t, str) and t for t in texts)):
        return False
    user = data.get("user")
    return data.get("encoding_format") in (None, "float", "base64") and (
        user is None or isinstance(user, str))


class Lanes:
    """The lanes by path, for the edge: `lane = lanes.get(path)`, then `await lane(...)`, which
    answers the request (None) or gives back the receive channel that replays its body for the
    regular route."""

    def __init__(self) -> None:
        self._by_path: dict[str, Lane] = {CHAT_PATH: self._chat, EMBEDDINGS_PATH: self._embed}

    def get(self, path: str) -> Lane | None:
        return self._by_path.get(path)

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        read, data, priority = await _read(scope, receive)
        if data is None or not plain_chat(data):
            return _replay(read, receive)
        state: FrontState = scope["app"].state.front
        if mcp_servers_of(data, state.catalog.settings) is not None:
            return _replay(read, receive)  # a preset that runs the MCP tool loop
        body = _body(read)
        # A non-streamed answer is awaited watching the client: one that leaves stops it.
        watch = ClientWatch(receive, scope.get(CLIENT_GONE))
        relay: Relay = await watched(watch, state.dispatch.open_relay(
            data["model"], CHAT_PATH, body, priority=priority))
        raw = await relay.read()
        if relay.status != 200:  # the route's own error answer (not a hot path)
            failed = openai_upstream_error(relay.status, relay.content_type, raw)
            await failed(scope, receive, send)
            return None
        headers = _JSON
        note = relay.header(SPECULATIVE_HEADER)
        if note is not None:
            headers = [*_JSON, (SPECULATIVE_HEADER.lower().encode(), note.encode("latin-1"))]
        await _answer(send, 200, headers, raw)
        return None

    async def _embed(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        read, data, priority = await _read(scope, receive)
        if data is None or not plain_embedding(data):
            return _replay(read, receive)
        body = _body(read)
        state: FrontState = scope["app"].state.front
        model = data["model"]
        await require_kind(state, model, "embedding")
        relay = await state.dispatch.open_relay(
            model, upstream_path(state, model), body, priority=priority, client=receive)
        raw = await relay.read()  # closes the relay: the lease goes back
        if relay.status != 200:
            await passthrough_error(relay, raw)(scope, receive, send)
        else:
            await _answer(send, 200, _JSON, raw)
        return None


async def _read(scope: Scope, receive: Receive) -> tuple[list[Message], Any, int]:
    """The messages that brought the body, its JSON (None: not JSON, a client gone before its
    end, or a request off the lane by its headers) and the request's priority."""
    read: list[Message] = []
    while True:
        message = await receive()
        read.append(message)
        if message["type"] != "http.request":
            return read, None, 0  # the client left: the regular route hears it (replayed)
        if not message.get("more_body", False):
            break
    raw_priority = None
    for name, value in scope["headers"]:
        if name in _OFF_LANE:
            return read, None, 0
        if name == _PRIORITY and raw_priority is None:
            raw_priority = value.decode("latin-1")
    try:
        data = orjson.loads(_body(read))
    except orjson.JSONDecodeError:
        return read, None, 0
    priority = 0 if raw_priority is None else priority_for(
        raw_priority, scope["modelyard.principal"])
    return read, data, priority


def _body(read: list[Message]) -> bytes:
    if len(read) == 1:
        return bytes(read[0].get("body", b""))
    return b"".join(message.get("body", b"") for message in read)


def _replay(read: list[Message], receive: Receive) -> Receive:
    """A receive channel that gives the messages `read` again, then the client's own."""
    pending = list(read)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


async def _answer(send: Send, status: int, headers: list[tuple[bytes, bytes]],
                  body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
