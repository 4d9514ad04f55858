"""Server-side chat sessions: the conversation lives on the server, keyed by (owner, id).

A chat request naming a session (the `session_id` body field or the `X-Session-Id` header; both
present and different is a 400 naming `session_id`) sends only its new messages: they are
spliced onto the stored history (`splice`), and the upstream body is built in one place,
`session_body`.
After a successful answer the turn is committed: the request's messages and the assistant's
reply (its content, and its `tool_calls` if any) become the history. A failed answer (an error
status, an in-band error, a client that left mid-stream) stores nothing of that turn.

Splicing rules: `front/chat/sessions/splice.py`.

A session is bound to the model of its first turn: a request naming another model is a 409
`conflict` (param `model`): the history was produced by, and is cached for, that model. Start a
new session (`GET /v1/sessions/{id}` gives the history to copy) or DELETE this one.

Bounds (config: `chat_session_*`): at most `chat_session_max_count` sessions and
`chat_session_max_total_bytes` in all, least recently used evicted first; one session over
`chat_session_max_bytes` loses its oldest turns (system messages stay; a single turn over the
bound drops the session); a session idle for `chat_session_ttl_s` expires (checked on access and
by a periodic sweep). With `chat_session_persist` the sessions are written (behind, by one writer
task; flushed at shutdown) to the SQLite table `chat_sessions` (`front/chat/sessions/db.py`) and
reloaded at start.

Several fronts on one database (PostgreSQL), or the workers of `serve --workers N` (on any
database: persistence is then on whatever `chat_session_persist` says), share the sessions
(`shared`): the database is the truth and each process's memory a cache of it. A session is
read back before each use (`refresh`; a listing or a stored response's lookup reads the
caller's rows: `refresh_all`), and a turn's change is in the database before its answer ends
(`settle`, awaited by the answer's last bytes), so a client's next turn, sent to any of them at
once, finds it; a session deleted by one is gone for the others. A session a process drops
from its memory (TTL, bounds) leaves the database's row alone if another used it since (it has
more turns there).

Ownership: a session belongs to the caller's user (anonymous callers share one owner, `""`);
another owner's session is "not found" (404 `session_not_found`), never "forbidden". Admins list
every session and may name another owner with `?owner=`.

Concurrent turns in one session are not serialised: the last to finish wins the history.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
import sqlalchemy as sa

from modelyard import metrics
from modelyard.config import Settings
from modelyard.errors import Conflict, InvalidRequest, SessionNotFound
from modelyard.front.chat.sessions import db as session_db
from modelyard.front.chat.sessions.answer import Answer, TurnStats
from modelyard.front.chat.sessions.kv import SlotKv
from modelyard.front.chat.sessions.splice import leading_system, splice
from modelyard.front.identity.principal import Principal

log = logging.getLogger("modelyard.sessions")

HEADER = "x-session-id"
RESPONSE_HEADER = "X-Session-Id"
BODY_FIELD = "session_id"
ANONYMOUS_OWNER = ""  # the owner of sessions made by anonymous callers (loopback, auth none)
_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def valid_session_id(value: object, param: str = BODY_FIELD) -> str:
    """1-128 characters of [A-Za-z0-9._:-]; anything else is a 400 naming `param`."""
    if isinstance(value, str) and _ID.fullmatch(value):
        return value
    raise InvalidRequest(
        f"{param}: must be 1-128 characters of A-Z a-z 0-9 . _ : - (got {str(value)[:40]!r})",
        param=BODY_FIELD,
    )


def requested_session_id(header: str | None, data: dict[str, Any]) -> str | None:
    """The session a request names (body field or header); the two that differ: 400."""
    field_value = data.get(BODY_FIELD)
    if field_value is None:
        return None if header is None else valid_session_id(header, "X-Session-Id")
    sid = valid_session_id(field_value)
    if header is not None and header != sid:
        raise InvalidRequest(
            f"{BODY_FIELD}: the body says {sid!r} but X-Session-Id says {header[:40]!r}",
            param=BODY_FIELD,
        )
    return sid


def owner_of(principal: Principal) -> str:
    return principal.user if principal.user is not None else ANONYMOUS_OWNER


def message_bytes(messages: Iterable[dict[str, Any]]) -> int:
    """Approximate size: the JSON encoding."""
    return sum(len(orjson.dumps(m)) for m in messages)


_MAX_TURN_STATS = 64  # per session, the most recent


@dataclass
class ChatSession:
    id: str
    owner: str
    model: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    created_at: float = 0.0
    last_used_at: float = 0.0
    size_bytes: int = 0
    turns: int = 0
    trimmed_messages: int = 0  # dropped to stay under chat_session_max_bytes
    cache_hits: int = 0  # turns whose prompt reused cached tokens
    cached_tokens_total: int = 0
    last_turns: list[TurnStats] = field(default_factory=list)  # most recent last
    extra: dict[str, Any] = field(default_factory=dict)  # for KV reuse (front/chat/sessions/kv.py)

    @property
    def tokens(self) -> int | None:
        """Tokens of the history as of the last turn (its prompt + completion), if known."""
        if not self.last_turns:
            return None
        last = self.last_turns[-1]
        if last.prompt_tokens is None:
            return None
        return last.prompt_tokens + (last.completion_tokens or 0)

    def view(self, *, with_messages: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "object": "chat.session",
            "owner": self.owner if self.owner != ANONYMOUS_OWNER else None,
            "model": self.model, "created_at": self.created_at,
            "last_used_at": self.last_used_at, "turns": self.turns,
            "messages_count": len(self.messages), "size_bytes": self.size_bytes,
            "tokens": self.tokens, "trimmed_messages": self.trimmed_messages,
            "cache": {"hits": self.cache_hits, "cached_tokens": self.cached_tokens_total,
                      "turns": [t.to_json() for t in self.last_turns]},
        }
        if with_messages:
            out["messages"] = self.messages
        return out


def session_body(session: ChatSession, request_body: dict[str, Any]) -> dict[str, Any]:
    """The upstream body for a turn of `session`: the request's fields without `session_id`,
    its messages spliced onto the history. The one place a session's upstream body is built
    (KV-reuse hints for the backend are added here)."""
    body = {k: v for k, v in request_body.items() if k != BODY_FIELD}
    body["messages"] = splice(session.messages, list(request_body.get("messages") or []))
    return body


# ---- the store ----------------------------------------------------------------------------


class Turn:
    """One request in a session: the spliced conversation it sends, committed on success."""

    def __init__(self, store: SessionStore, session: ChatSession, body: dict[str, Any]) -> None:
        self.store = store
        self.session = session
        self.body = body  # the upstream body (session_body's, plus KV hints)
        self.kv: SlotKv | None = None  # the llama-server slot work around it (session_kv.py)
        self._committed = False

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body["messages"])

    def with_messages(self, messages: list[dict[str, Any]]) -> Turn:
        """The conversation the answer follows, when it is more than what was sent (a tool
        loop's rounds)."""
        self.body = {**self.body, "messages": list(messages)}
        return self

    def commit(self, answer: Answer) -> bool:
        """Store the turn if the answer succeeded; True when it was stored. Idempotent."""
        if self._committed or not answer.ok:
            return False
        self._committed = True
        self.store.commit(self, answer)
        return True


class SessionStore:
    """Sessions in memory (LRU order), bounded, optionally written to SQLite behind."""

    def __init__(
        self,
        *,
        max_count: int = 256,
        max_bytes: int = 4 * 2**20,
        max_total_bytes: int = 256 * 2**20,
        ttl_s: float = 3600.0,
        sweep_interval_s: float = 60.0,
        database: sa.Engine | None = None,
        shared: bool = False,
        clock: Callable[[], float] = time.time,
        on_drop: Callable[[str, str], None] | None = None,
    ) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.max_total_bytes = max_total_bytes
        self.ttl_s = ttl_s
        self.sweep_interval_s = sweep_interval_s
        self.db = database
        # Other processes write the same rows: on SQLite only `serve --workers N`'s (`shared`
        # asked), on another database any front's.
        self.shared = database is not None and (shared or database.dialect.name != "sqlite")
        self.clock = clock
        self._sessions: OrderedDict[tuple[str, str], ChatSession] = OrderedDict()  # LRU first
        self.total_bytes = 0
        self.evicted = {"count": 0, "bytes": 0, "ttl": 0, "size": 0}
        self._dirty: set[tuple[str, str]] = set()
        self._gone: dict[tuple[str, str], int] = {}  # dropped, not yet written: their turns
        self._writing = asyncio.Lock()  # one write at a time: the latest change lands last
        self._wake = asyncio.Event()
        self._closing = False
        self._tasks: list[asyncio.Task[None]] = []
        # Told (owner, id) of each session that is dropped: its KV files go too.
        self.on_drop = on_drop

    @classmethod
    def for_settings(
        cls,
        settings: Settings,
        database: sa.Engine | None,
        on_drop: Callable[[str, str], None] | None = None,
    ) -> SessionStore:
        workers = settings.worker_count > 1  # one process's memory would be one worker's
        return cls(
            max_count=settings.chat_session_max_count,
            max_bytes=settings.chat_session_max_bytes,
            max_total_bytes=settings.chat_session_max_total_bytes,
            ttl_s=settings.chat_session_ttl_s,
            sweep_interval_s=settings.chat_session_sweep_interval_s,
            database=database if settings.chat_session_persist or workers else None,
            shared=workers,
            on_drop=on_drop,
        )

    def __len__(self) -> int:
        return len(self._sessions)

    def stats(self) -> dict[str, Any]:
        """For /status: how many, how big, how many were evicted and why."""
        return {"count": len(self._sessions), "bytes": self.total_bytes,
                "evicted": dict(self.evicted), "persisted": self.db is not None}

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Reload persisted sessions (dropping expired ones), start the sweeper and writer."""
        if self.db is not None:
            loaded = await asyncio.to_thread(self._load_all)
            for session in sorted(loaded, key=lambda s: s.last_used_at):
                self._put(session)
            self._enforce(keep=None)
            log.info("sessions: reloaded %d", len(self._sessions))
            self._tasks.append(asyncio.create_task(self._write_behind(), name="session-writer"))
        self._tasks.append(asyncio.create_task(self._sweep_forever(), name="session-sweeper"))

    async def stop(self) -> None:
        """Stop the sweeper; let the writer finish (never cancelled mid-write, so no older write
        can land after a newer one), then write what is still pending."""
        self._closing = True
        self._wake.set()
        for task in self._tasks:
            if task.get_name() == "session-sweeper":
                task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        try:
            await self.flush()
        except Exception:  # the shutdown goes on; what was not written is lost
            log.exception("sessions: writing to the database at shutdown failed")

    async def flush(self) -> None:
        """Write every pending change now (persistence on)."""
        if self.db is None:
            self._dirty.clear()
            return
        async with self._writing:
            while self._dirty:
                batch = self._take_dirty(list(self._dirty))
                await asyncio.to_thread(self._write, batch)

    async def settle(self, owner: str, session_id: str) -> None:
        """Shared: the session's pending change written now, before the answer that made it
        ends (another process may get the client's next request at once). Otherwise nothing:
        the writer task writes behind."""
        key = (owner, session_id)
        if not self.shared or key not in self._dirty:
            return
        async with self._writing:
            if key in self._dirty:
                await asyncio.to_thread(self._write, self._take_dirty([key]))

    def pending(self, owner: str, session_id: str) -> bool:
        """Shared, and the session has a change `settle` would write."""
        return self.shared and (owner, session_id) in self._dirty

    # ---- lookups ---------------------------------------------------------------------------

    def get(self, owner: str, session_id: str) -> ChatSession | None:
        """The live session (an expired one is dropped here); does not touch its LRU place."""
        key = (owner, session_id)
        session = self._sessions.get(key)
        if session is not None and self._expired(session):
            self._drop(key, "ttl")
            return None
        return session

    def find(self, principal: Principal, session_id: str, owner: str | None = None
             ) -> ChatSession:
        """The caller's session (admins: `owner`'s, else their own, else the only one with that
        id); another owner's is SessionNotFound."""
        if owner is not None and principal.is_admin:
            found = self.get(owner, session_id)
        else:
            found = self.get(owner_of(principal), session_id)
            if found is None and principal.is_admin:
                matches = [s for s in self.list_for(principal) if s.id == session_id]
                found = matches[0] if len(matches) == 1 else None
        if found is None:
            raise SessionNotFound.for_id(session_id)
        return found

    def list_for(self, principal: Principal) -> list[ChatSession]:
        """The caller's sessions (admins: all), most recently used first."""
        self.sweep()
        mine = owner_of(principal)
        return [s for s in reversed(self._sessions.values())
                if principal.is_admin or s.owner == mine]

    async def refresh(self, owner: str, session_id: str) -> None:
        """Shared: the session as the database has it (see the module doc)."""
        if not self.shared:
            return
        assert self.db is not None
        row = await asyncio.to_thread(session_db.load_one, self.db, owner, session_id)
        self._reconcile([(owner, session_id)], [] if row is None else [row])

    async def refresh_all(self, principal: Principal) -> None:
        """Shared: the caller's sessions (an admin's: every one) as the database has them."""
        if not self.shared:
            return
        assert self.db is not None
        owner = None if principal.is_admin else owner_of(principal)
        rows = await asyncio.to_thread(session_db.load_owned, self.db, owner)
        self._reconcile([k for k in self._sessions if owner is None or k[0] == owner], rows)

    def _reconcile(self, keys: list[tuple[str, str]], rows: list[dict[str, Any]]) -> None:
        """Take each row newer than our copy (another process answered or changed it since:
        more turns, or as many used later); forget our copies of `keys` the database no
        longer has (deleted elsewhere), unless our own change of it is not written yet."""
        now = self.clock()
        found = set()
        for row in rows:
            key = (row["owner"], row["id"])
            found.add(key)
            mine = self._sessions.get(key)
            if now - row["last_used_at"] > self.ttl_s or key in self._dirty:
                continue
            if mine is None or (row["turns"], row["last_used_at"]) > (
                    mine.turns, mine.last_used_at):
                self._put(_session(row))
                self._enforce(keep=key)
        for key in keys:
            if key not in found and key not in self._dirty:
                self._remove(key)

    # ---- turns -----------------------------------------------------------------------------

    def begin(self, owner: str, session_id: str, model: str, request_body: dict[str, Any]
              ) -> Turn:
        """Start a turn: the session (made if new; a 409 if it is another model's) and the
        spliced upstream body. Nothing is stored until `Turn.commit`."""
        session = self.get(owner, session_id)
        now = self.clock()
        if session is None:
            session = ChatSession(session_id, owner, model, created_at=now, last_used_at=now)
        elif session.model != model:
            raise Conflict(
                f"session {session_id!r} is a conversation with '{session.model}', not "
                f"'{model}': start a new session (GET /v1/sessions/{session_id} gives its "
                "history) or DELETE it first", param="model", model=model)
        return Turn(self, session, session_body(session, request_body))

    def commit(self, turn: Turn, answer: Answer) -> None:
        """The turn's conversation and the reply become the session's history."""
        session = turn.session
        key = (session.owner, session.id)
        now = self.clock()
        live = self._sessions.get(key)
        if live is not None and live is not session:  # replaced meanwhile (deleted + new)
            session = live
        session.messages = [*turn.messages, answer.message()]
        session.last_used_at = now
        session.turns += 1
        stats = answer.stats(now)
        metrics.session_turn(session.model, stats.cached_tokens if stats else None)
        if stats is not None:
            session.last_turns = [*session.last_turns, stats][-_MAX_TURN_STATS:]
            if stats.cached_tokens:
                session.cache_hits += 1
                session.cached_tokens_total += stats.cached_tokens
        self._remove(key)
        if not self._trim(session):
            self.evicted["size"] += 1
            self._gone[key] = session.turns
            self._mark(key)
            if self.on_drop is not None:
                self.on_drop(*key)
            return
        self._put(session)
        self._mark(key)
        self._enforce(keep=key)

    def changed(self, session: ChatSession) -> None:
        """`session.extra` changed outside a turn (a stored response kept or forgotten): written
        behind like a turn. Shared: it counts as a use, so the others take this copy."""
        if self.shared:
            session.last_used_at = max(self.clock(), session.last_used_at)
        self._mark((session.owner, session.id))

    # ---- deleting --------------------------------------------------------------------------

    def delete(self, principal: Principal, session_id: str, owner: str | None = None) -> None:
        session = self.find(principal, session_id, owner)
        self._drop((session.owner, session.id), None)

    def delete_all(self, principal: Principal) -> int:
        """The caller's own sessions (admins' too: only their own)."""
        mine = owner_of(principal)
        keys = [k for k in self._sessions if k[0] == mine]
        for key in keys:
            self._drop(key, None)
        return len(keys)

    def sweep(self) -> int:
        """Drop expired sessions; how many. The LRU order is the order of `last_used_at`
        (a commit moves its session to the end), so the expired ones are a prefix."""
        expired = []
        for key, session in self._sessions.items():
            if not self._expired(session):
                break
            expired.append(key)
        for key in expired:
            self._drop(key, "ttl")
        return len(expired)

    # ---- internals -------------------------------------------------------------------------

    def _expired(self, session: ChatSession) -> bool:
        return self.clock() - session.last_used_at > self.ttl_s

    def _put(self, session: ChatSession) -> None:
        key = (session.owner, session.id)
        self._remove(key)
        session.size_bytes = message_bytes(session.messages)
        self._sessions[key] = session
        self.total_bytes += session.size_bytes

    def _remove(self, key: tuple[str, str]) -> ChatSession | None:
        session = self._sessions.pop(key, None)
        if session is not None:
            self.total_bytes -= session.size_bytes
        return session

    def _drop(self, key: tuple[str, str], why: str | None) -> None:
        if (session := self._remove(key)) is not None:
            self._gone[key] = session.turns
            if why is not None:
                self.evicted[why] += 1
            self._mark(key)
            if self.on_drop is not None:
                self.on_drop(*key)

    def _trim(self, session: ChatSession) -> bool:
        """Drop the oldest turns until the session fits max_bytes; False: even one does not."""
        size = message_bytes(session.messages)
        if size <= self.max_bytes:
            return True
        messages = session.messages
        systems = leading_system(messages)
        rest = messages[systems:]
        while rest and size > self.max_bytes:
            # A turn: up to (not including) the next user message after the first one.
            cut = next((i for i in range(1, len(rest)) if rest[i].get("role") == "user"),
                       len(rest))
            if cut == len(rest):
                return False
            size -= message_bytes(rest[:cut])
            session.trimmed_messages += cut
            rest = rest[cut:]
        session.messages = [*messages[:systems], *rest]
        return size <= self.max_bytes

    def _enforce(self, keep: tuple[str, str] | None) -> None:
        """LRU eviction down to max_count and max_total_bytes (never `keep`, if it fits)."""
        self.sweep()
        while len(self._sessions) > self.max_count:
            victim = next(k for k in self._sessions if k != keep or len(self._sessions) == 1)
            self._drop(victim, "count")
        while self.total_bytes > self.max_total_bytes and self._sessions:
            others = [k for k in self._sessions if k != keep]
            self._drop(others[0] if others else next(iter(self._sessions)), "bytes")

    def _mark(self, key: tuple[str, str]) -> None:
        if self.db is not None:
            self._dirty.add(key)
            self._wake.set()

    def _take_dirty(self, keys: list[tuple[str, str]]) -> list[session_db.Change]:
        """The changes of `keys`, taken out of the pending set: a session's row, or the turns
        of one dropped (its row goes only if no other process added turns since)."""
        batch: list[session_db.Change] = []
        for key in keys:
            self._dirty.discard(key)
            gone = self._gone.pop(key, None)
            session = self._sessions.get(key)
            batch.append((key, _row(session)) if session is not None else
                         (key, gone if gone is not None else session_db.ALL_TURNS))
        return batch

    async def _write_behind(self) -> None:
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.flush()
            except Exception:  # a full disk must not stop the server; the next change retries
                log.exception("sessions: writing to the database failed")

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            self.sweep()

    def _write(self, batch: list[session_db.Change]) -> None:
        assert self.db is not None
        session_db.write(self.db, batch)

    def _load_all(self) -> list[ChatSession]:
        assert self.db is not None
        rows = session_db.load(self.db, expired_before=self.clock() - self.ttl_s)
        return [_session(r) for r in rows]


def _row(session: ChatSession) -> dict[str, Any]:
    return {
        "owner": session.owner, "id": session.id, "model": session.model,
        "messages": session.messages, "created_at": session.created_at,
        "last_used_at": session.last_used_at, "turns": session.turns,
        "stats": {"trimmed_messages": session.trimmed_messages,
                  "cache_hits": session.cache_hits,
                  "cached_tokens_total": session.cached_tokens_total,
                  "last_turns": [t.to_json() for t in session.last_turns],
                  "extra": session.extra},
    }


def _session(row: dict[str, Any]) -> ChatSession:
    stats = row.get("stats") or {}
    return ChatSession(
        id=row["id"], owner=row["owner"], model=row["model"], messages=list(row["messages"]),
        created_at=row["created_at"], last_used_at=row["last_used_at"], turns=row["turns"],
        trimmed_messages=int(stats.get("trimmed_messages") or 0),
        cache_hits=int(stats.get("cache_hits") or 0),
        cached_tokens_total=int(stats.get("cached_tokens_total") or 0),
        last_turns=[TurnStats.from_json(t) for t in stats.get("last_turns") or []],
        extra=dict(stats.get("extra") or {}),
    )
