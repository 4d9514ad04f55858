"""KV-cache reuse for chat sessions: what the front adds to a session turn so that the backend
does not prefill the whole conversation again, even after other traffic used its cache.

llama.cpp (a llama-server started with `--slot-save-path`, as the default argv is): each session
has a home slot (a hash of the session into `--parallel`), sent as `id_slot` with
`cache_prompt`. Before a turn the session's saved KV is restored into that slot (unless the slot
still holds it: the front sees every request a backend gets); after a turn that succeeded, the
slot is saved to a file named after the session. Restore and save take ~15 ms for 2000 tokens of
the demo model against ~12 s of prefill on two CPU cores; llama-server defers either until the
slot is idle, and a slot that another request took meanwhile only costs a cache miss (the file
carries its tokens, so a mismatched prefix is never reused). The files survive the model being
swapped out, and are deleted when the session is.

transformers: the turn carries `x_modelyard_session`; the engine keeps the session's KV pinned
apart from its shared prefix cache (engine/backends/transformers).

Other backends get nothing: they keep their own prompt caches.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

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
    """One session turn's use of a llama-server slot: restore before, save after."""

    slot: int
    filename: str
    directory: Path
    holders: dict[tuple[str, int], str]  # (upstream, slot) -> the file it last held
    saves: dict[str, asyncio.Future[bool]]  # file -> its save in progress
    committed: bool = False
    restored: bool | None = field(default=None, init=False)
    saving: asyncio.Future[bool] | None = field(default=None, init=False)
    _sent_to: tuple[aiohttp.ClientSession, str] | None = field(default=None, init=False)

    @property
    def path(self) -> Path:
        return self.directory / self.filename

    async def before(self, http: aiohttp.ClientSession, upstream: str) -> None:
        """Put the session's KV back into its slot, unless the slot still holds it."""
        previous = self.saves.get(self.filename)
        if previous is not None:  # the last turn's save, still on its way
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(previous), SLOT_TIMEOUT_S)
        if self.holders.get((upstream, self.slot)) == self.filename or not self.path.is_file():
            self.restored = False
            return
        self.holders.pop((upstream, self.slot), None)
        self.restored = await _slot_action(http, upstream, self.slot, "restore", self.filename)

    def after(self, http: aiohttp.ClientSession, upstream: str) -> None:
        """The request is over (its lease about to go): save the slot if the turn is stored."""
        self._sent_to = (http, upstream)
        self._save()

    def commit(self) -> None:
        """The turn is stored (a whole answer is stored after its request is over)."""
        self.committed = True
        self._save()

    def _save(self) -> None:
        """Fire and forget: llama-server runs it once the slot is idle, i.e. right after the
        answer. Nothing for a failed turn; once per turn."""
        if not self.committed or self._sent_to is None or self.saving is not None:
            return
        http, upstream = self._sent_to
        self.holders[(upstream, self.slot)] = self.filename
        self.saving = asyncio.ensure_future(
            _slot_action(http, upstream, self.slot, "save", self.filename)
        )
        self.saves[self.filename] = self.saving
        self.saving.add_done_callback(
            lambda done: self.saves.pop(self.filename, None) if self.saves.get(
                self.filename) is done else None)


async def _slot_action(
    http: aiohttp.ClientSession, upstream: str, slot: int, action: str, filename: str
) -> bool:
    """POST /slots/{slot}?action=…; a failure is only a lost cache hit, so it is logged."""
    try:
        async with http.post(
            f"{upstream}/slots/{slot}", params={"action": action}, json={"filename": filename},
            timeout=aiohttp.ClientTimeout(total=SLOT_TIMEOUT_S),
        ) as response:
            if response.status == 200:
                return True
            log.info("slot %s %d on %s: HTTP %d %s", action, slot, upstream, response.status,
                     (await response.text())[:200])
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.info("slot %s %d on %s failed: %s", action, slot, upstream, exc)
    return False


class SessionKv:
    """The front's side of session KV reuse (one per front)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.directory = settings.session_kv_dir
        # (upstream, slot) -> the session file it holds since the last save. A request without a
        # slot may land in any slot, so it clears its upstream's; a session turn only uses its own.
        self.holders: dict[tuple[str, int], str] = {}
        self.saves: dict[str, asyncio.Future[bool]] = {}

    def plan(
        self, spec: Any, key: str, body: dict[str, Any]
    ) -> tuple[dict[str, Any], SlotKv | None]:
        """The turn's upstream body with the backend's hints, and the slot work around it."""
        if isinstance(spec, TransformersModel):
            return {**body, TRANSFORMERS_FIELD: key}, None
        slots = _slots(spec, self.settings)
        if slots is None:
            return body, None
        slot = int(key[:8], 16) % slots
        name = f"{key}-{_model_version(spec)}.bin"
        kv = SlotKv(slot, name, self.directory, self.holders, self.saves)
        return {**body, "id_slot": slot, "cache_prompt": True}, kv

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
