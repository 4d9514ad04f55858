"""KV-cache reuse for chat sessions: what the front adds to a session turn so that the backend
does not prefill the whole conversation again, even after other traffic used its cache.

llama.cpp (a llama-server started with `--slot-save-path`, as the default argv is): each session
has a home slot (a hash of the session into `--parallel`; another free slot when a turn of
another session is in flight there), sent as `id_slot` with `cache_prompt`. Before a turn the
session's saved KV is restored into that slot (unless the slot still holds it: the front sees
every request a backend gets); after a turn the backend answered, the slot is saved to a file
named after the session, the lease held until the save is done (an unload cannot cut it short).
Restore and save take ~15 ms for 2000 tokens of the demo model against ~12 s of prefill on two
CPU cores; llama-server defers either until the slot is idle, and a slot that another request
took meanwhile only costs a cache miss (the file carries its tokens, so a mismatched prefix is
never reused). The files survive the model being swapped out, and are deleted when the session
is.

What the backend can do is the engine's knowledge, asked through its `EngineClient` once the turn
holds a lease (wire/engines.py `kv_slots`, `kv_slot`, `kv_drop`): whether the model's server saves
slots and how many it has, where the files are, and which file is the session's. The front only
chooses the slot and when to restore and save; the slot hints go into the body then.

transformers: the turn carries `x_modelyard_session`; the engine keeps the session's KV pinned
apart from its shared prefix cache (engine/backends/transformers).

Other backends get nothing: they keep their own prompt caches.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from modelyard.config import LlamaCppModel, OpenAIServerModel, TransformersModel
from modelyard.front.engines.client import EngineClient

log = logging.getLogger(__name__)

TRANSFORMERS_FIELD = "x_modelyard_session"
SLOT_TIMEOUT_S = 10.0


def session_key(owner: str, session_id: str) -> str:
    """An opaque name for a session (file names, engine pins): never the owner or the id."""
    return hashlib.sha256(f"{owner}\0{session_id}".encode()).hexdigest()[:32]


@dataclass
class SlotKv:
    """One session turn's use of a llama-server slot: claim and restore before, save after."""

    owner: SessionKv
    key: str  # the session's (session_key)
    model: str
    home: int = field(default=0, init=False)  # the session's usual slot
    slots: int | None = field(default=None, init=False)  # how many the server has (None: none)
    slot: int = field(default=0, init=False)  # where this turn runs (home, unless taken)
    restored: bool | None = field(default=None, init=False)
    saving: asyncio.Future[bool] | None = field(default=None, init=False)
    _claimed: str | None = field(default=None, init=False)  # the upstream whose slot it holds
    _engine: EngineClient | None = field(default=None, init=False)

    @property
    def filename(self) -> str:
        """What the front calls the session's saved KV of this model (the engine names the
        file itself)."""
        return f"{self.key}:{self.model}"

    async def prepare(self, engine: EngineClient, upstream: str, payload: bytes) -> bytes:
        """Claim a slot and put the session's KV back into it; the payload names the slot.

        Another session turn in flight on the home slot would make llama-server queue this
        one behind it (`id_slot` waits for its slot): any free slot serves as well, since the
        KV comes from the file. A server that saves no slots gets the payload as it is."""
        self.slots = await self.owner.slots_of(engine, self.model, upstream)
        if self.slots is None:
            return payload
        self._engine = engine
        self.home = self.slot = int(self.key[:8], 16) % self.slots
        claims = self.owner.claims.setdefault(upstream, collections.Counter())
        if claims[self.home]:
            self.slot = next((s for s in range(self.slots) if not claims[s]), self.home)
        claims[self.slot] += 1
        self._claimed = upstream
        payload = orjson.dumps({**orjson.loads(payload), "id_slot": self.slot,
                                "cache_prompt": True})
        await self._restore(engine, upstream)
        return payload

    async def _restore(self, engine: EngineClient, upstream: str) -> None:
        """Unless the slot still holds the session's KV (nothing else ran there since)."""
        previous = self.owner.saves.get(self.filename)
        if previous is not None:  # the last turn's save, still on its way
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(previous), SLOT_TIMEOUT_S)
        holders = self.owner.holders
        if holders.get((upstream, self.slot)) == self.filename:
            self.restored = False
            return
        holders.pop((upstream, self.slot), None)
        self.restored = await _slot(engine, self.model, self.slot, "restore", self.key)

    def after(self, upstream: str, ok: bool) -> asyncio.Future[bool] | None:
        """The request is over: save the slot (once) if the backend answered it. The caller
        keeps the lease until the save is done, so the model cannot be unloaded under it."""
        self.release()
        engine = self._engine
        if not ok or self.saving is not None or engine is None:
            return None
        self.owner.holders[(upstream, self.slot)] = self.filename
        saves = self.owner.saves
        saving = self.saving = asyncio.ensure_future(
            _slot(engine, self.model, self.slot, "save", self.key)
        )
        saves[self.filename] = saving

        def forget(done: asyncio.Future[bool]) -> None:
            if saves.get(self.filename) is done:
                del saves[self.filename]

        saving.add_done_callback(forget)
        return saving

    def release(self) -> None:
        """Give the slot claim back (the request ended, or never went)."""
        if self._claimed is not None:
            claims = self.owner.claims.get(self._claimed)
            if claims is not None:
                claims[self.slot] -= 1
                if claims[self.slot] <= 0:
                    del claims[self.slot]
            self._claimed = None


async def _slot(engine: EngineClient, model: str, slot: int, action: Any, key: str) -> bool:
    """The engine restores or saves the slot; a failure is only a lost cache hit (logged)."""
    try:
        return await asyncio.wait_for(engine.kv_slot(model, slot, action, key), SLOT_TIMEOUT_S)
    except Exception as exc:
        log.info("slot %s %d of %s on %s failed: %s", action, slot, model, engine.name, exc)
        return False


class SessionKv:
    """The front's side of session KV reuse (one per front)."""

    def __init__(self, engines: Callable[[], Sequence[EngineClient]]) -> None:
        self.engines = engines
        # (upstream, slot) -> the session KV it holds since the last save. A request without a
        # slot may land in any slot, so it clears its upstream's; a session turn only uses its own.
        self.holders: dict[tuple[str, int], str] = {}
        self.saves: dict[str, asyncio.Future[bool]] = {}  # session KV -> its save in progress
        # upstream -> slot -> session turns in flight there
        self.claims: dict[str, collections.Counter[int]] = {}
        # (engine, model, upstream) -> its server's slots: one question per model load
        self._slots: dict[tuple[str, str, str], int | None] = {}

    def plan(
        self, spec: Any, key: str, body: dict[str, Any]
    ) -> tuple[dict[str, Any], SlotKv | None]:
        """The turn's upstream body with the backend's hints, and the slot work around it (the
        engine that serves the turn says, once leased, whether its server saves slots)."""
        if isinstance(spec, TransformersModel):
            return {**body, TRANSFORMERS_FIELD: key}, None
        if not isinstance(spec, LlamaCppModel | OpenAIServerModel):
            return body, None
        return body, SlotKv(self, key, spec.id)

    async def slots_of(self, engine: EngineClient, model: str, upstream: str) -> int | None:
        where = (engine.name, model, upstream)
        if where not in self._slots:
            try:
                self._slots[where] = await engine.kv_slots(model)
            except Exception as exc:  # no slot hints this turn; asked again next turn
                log.info("%s did not say the slots of %s: %s", engine.name, model, exc)
                return None
        return self._slots[where]

    def sending(self, upstream: str, kv: SlotKv | None) -> None:
        """A request goes to `upstream`; one without a slot may overwrite any slot there."""
        if kv is None and self.holders:
            for held in [h for h in self.holders if h[0] == upstream]:
                del self.holders[held]

    def drop_session(self, owner: str, session_id: str) -> None:
        self.drop(session_key(owner, session_id))

    def drop(self, key: str) -> None:
        """The session is gone: so are its saved slots, in every engine."""
        for engine in self.engines():
            try:
                engine.kv_drop(key)
            except Exception as exc:
                log.info("%s: dropping a session's saved KV failed: %s", engine.name, exc)
        for held in [h for h, f in self.holders.items() if f.startswith(key + ":")]:
            del self.holders[held]
