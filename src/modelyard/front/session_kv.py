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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from modelyard.config import LlamaCppModel, OpenAIServerModel, Settings, TransformersModel
from modelyard.engine.backends.llamacpp import llama_server_argv

log = logging.getLogger(__name__)

TRANSFORMERS_FIELD = "x_modelyard_session"
SLOT_TIMEOUT_S = 10.0


def session_key(owner: str, session_id: str) -> str:
    """An opaque name for a session (file names, engine pins): never the owner or the id."""
    return hashlib.sha256(f"{owner}\0{session_id}".encode()).hexdigest()[:32]


def _model_version(spec: LlamaCppModel | OpenAIServerModel) -> str:
    """Tells apart KV made by another file under the same model id (re-pulled, replaced)."""
    path = getattr(spec, "path", None)
    try:
        stat = Path(path).stat() if path is not None else None
    except OSError:
        stat = None
    version = f"{spec.id}\0{path}\0{stat.st_mtime_ns if stat else 0}\0{stat.st_size if stat else 0}"
    return hashlib.sha256(version.encode()).hexdigest()[:16]


def _slots(spec: Any, settings: Settings) -> int | None:
    """How many slots the model's llama-server has, when it saves slots; else None."""
    if isinstance(spec, LlamaCppModel):
        try:
            argv, values = llama_server_argv(spec, settings)
        except Exception:  # no binary: the load will say so
            return None
    elif isinstance(spec, OpenAIServerModel):
        argv, values = spec.argv + spec.extra_args, {}
    else:
        return None
    if "--slot-save-path" not in argv:
        return None
    parallel = _flag_value(argv, ("--parallel", "-np"))
    text = values.get("parallel", "1") if parallel in (None, "$parallel") else parallel
    try:
        return max(1, int(text))
    except ValueError:
        return 1


def _flag_value(argv: list[str], names: tuple[str, ...]) -> str | None:
    for i, arg in enumerate(argv[:-1]):
        if arg in names:
            return argv[i + 1]
    return None


@dataclass
class SlotKv:
    """One session turn's use of a llama-server slot: claim and restore before, save after."""

    owner: SessionKv
    home: int  # the session's usual slot
    slots: int  # how many the server has
    filename: str
    slot: int = field(init=False)  # where this turn runs (home, unless another turn holds it)
    restored: bool | None = field(default=None, init=False)
    saving: asyncio.Future[bool] | None = field(default=None, init=False)
    _claimed: str | None = field(default=None, init=False)  # the upstream whose slot it holds

    def __post_init__(self) -> None:
        self.slot = self.home

    @property
    def path(self) -> Path:
        return self.owner.directory / self.filename

    async def prepare(self, http: aiohttp.ClientSession, upstream: str, payload: bytes) -> bytes:
        """Claim a slot and put the session's KV back into it; the payload names the slot.

        Another session turn in flight on the home slot would make llama-server queue this
        one behind it (`id_slot` waits for its slot): any free slot serves as well, since the
        KV comes from the file."""
        claims = self.owner.claims.setdefault(upstream, collections.Counter())
        if claims[self.home]:
            self.slot = next((s for s in range(self.slots) if not claims[s]), self.home)
        claims[self.slot] += 1
        self._claimed = upstream
        if self.slot != self.home:
            payload = orjson.dumps({**orjson.loads(payload), "id_slot": self.slot})
        await self._restore(http, upstream)
        return payload

    async def _restore(self, http: aiohttp.ClientSession, upstream: str) -> None:
        """Unless the slot still holds the session's KV (nothing else ran there since)."""
        previous = self.owner.saves.get(self.filename)
        if previous is not None:  # the last turn's save, still on its way
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(previous), SLOT_TIMEOUT_S)
        holders = self.owner.holders
        if holders.get((upstream, self.slot)) == self.filename or not self.path.is_file():
            self.restored = False
            return
        holders.pop((upstream, self.slot), None)
        self.restored = await _slot_action(http, upstream, self.slot, "restore", self.filename)

    def after(self, http: aiohttp.ClientSession, upstream: str, ok: bool
              ) -> asyncio.Future[bool] | None:
        """The request is over: save the slot (once) if the backend answered it. The caller
        keeps the lease until the save is done, so the model cannot be unloaded under it."""
        self.release()
        if not ok or self.saving is not None:
            return None
        self.owner.holders[(upstream, self.slot)] = self.filename
        saves = self.owner.saves
        saving = self.saving = asyncio.ensure_future(
            _slot_action(http, upstream, self.slot, "save", self.filename)
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


async def _slot_action(
    http: aiohttp.ClientSession, upstream: str, slot: int, action: str, filename: str
) -> bool:
    """POST /slots/{slot}?action=…; a failure is only a lost cache hit, so it is logged. A pooled
    connection the server closed while idle ("Server disconnected", "Can not write request
    body") is retried once: both actions are idempotent."""
    for attempt in (1, 2):
        try:
            async with http.post(
                f"{upstream}/slots/{slot}", params={"action": action},
                json={"filename": filename}, timeout=aiohttp.ClientTimeout(total=SLOT_TIMEOUT_S),
            ) as response:
                if response.status == 200:
                    return True
                log.info("slot %s %d on %s: HTTP %d %s", action, slot, upstream,
                         response.status, (await response.text())[:200])
                return False
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if attempt == 2:
                log.info("slot %s %d on %s failed: %s", action, slot, upstream, exc)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("slot %s %d on %s failed: %s", action, slot, upstream, exc)
            return False
    return False


class SessionKv:
    """The front's side of session KV reuse (one per front)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.directory = settings.session_kv_dir
        # (upstream, slot) -> the session file it holds since the last save. A request without a
        # slot may land in any slot, so it clears its upstream's; a session turn only uses its own.
        self.holders: dict[tuple[str, int], str] = {}
        self.saves: dict[str, asyncio.Future[bool]] = {}  # file -> its save in progress
        # upstream -> slot -> session turns in flight there
        self.claims: dict[str, collections.Counter[int]] = {}

    def plan(
        self, spec: Any, key: str, body: dict[str, Any]
    ) -> tuple[dict[str, Any], SlotKv | None]:
        """The turn's upstream body with the backend's hints, and the slot work around it."""
        if isinstance(spec, TransformersModel):
            return {**body, TRANSFORMERS_FIELD: key}, None
        slots = _slots(spec, self.settings)
        if slots is None:
            return body, None
        kv = SlotKv(self, int(key[:8], 16) % slots, slots, f"{key}-{_model_version(spec)}.bin")
        return {**body, "id_slot": kv.home, "cache_prompt": True}, kv

    def sending(self, upstream: str, kv: SlotKv | None) -> None:
        """A request goes to `upstream`; one without a slot may overwrite any slot there."""
        if kv is None and self.holders:
            for held in [h for h in self.holders if h[0] == upstream]:
                del self.holders[held]

    def drop_session(self, owner: str, session_id: str) -> None:
        self.drop(session_key(owner, session_id))

    def drop(self, key: str) -> None:
        """The session is gone: so are its saved slots."""
        for path in self.directory.glob(f"{key}-*.bin"):
            with contextlib.suppress(OSError):
                path.unlink()
        for held in [h for h, f in self.holders.items() if f.startswith(key + "-")]:
            del self.holders[held]
