"""The engine's side of session KV reuse: its llama-servers' slots (front/chat/sessions/kv.py
decides when a session turn restores and saves; this module knows how).

Only the engine knows a backend's command line (whether it saves slots: `--slot-save-path`, and
how many it has: `--parallel`), where the slot files are, and which file a session's KV of a
model lives in (named after the session and the model file's version, so KV made by another
file under the same id is never restored). The front asks through its `EngineClient`
(`kv_slots`, `kv_slot`, `kv_drop`; wire/engines.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from pathlib import Path
from typing import Any

import aiohttp

from modelyard.config import LlamaCppModel, OpenAIServerModel, Settings
from modelyard.engine.backends.keys import auth_headers
from modelyard.engine.backends.llamacpp import llama_server_argv
from modelyard.engine.loop import Engine
from modelyard.errors import InvalidRequest, ModelyardError

log = logging.getLogger(__name__)

SLOT_TIMEOUT_S = 10.0
ACTIONS = ("restore", "save")


def _model_version(spec: LlamaCppModel | OpenAIServerModel) -> str:
    """Tells apart KV made by another file under the same model id (re-pulled, replaced)."""
    path = getattr(spec, "path", None)
    try:
        stat = Path(path).stat() if path is not None else None
    except OSError:
        stat = None
    version = f"{spec.id}\0{path}\0{stat.st_mtime_ns if stat else 0}\0{stat.st_size if stat else 0}"
    return hashlib.sha256(version.encode()).hexdigest()[:16]


def slot_count(spec: Any, settings: Settings) -> int | None:
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


async def slot_action(
    http: aiohttp.ClientSession, upstream: str, slot: int, action: str, filename: str,
    api_key: str | None = None,
) -> bool:
    """POST /slots/{slot}?action=…; a failure is only a lost cache hit, so it is logged. A pooled
    connection the server closed while idle ("Server disconnected", "Can not write request
    body") is retried once: both actions are idempotent."""
    for attempt in (1, 2):
        try:
            async with http.post(
                f"{upstream}/slots/{slot}", params={"action": action},
                json={"filename": filename}, timeout=aiohttp.ClientTimeout(total=SLOT_TIMEOUT_S),
                headers=auth_headers(api_key),  # /slots is not a public route of llama-server
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


class SessionSlots:
    """One engine's slot operations (its settings and catalog change with reloads: read anew)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._http: aiohttp.ClientSession | None = None

    @property
    def directory(self) -> Path:
        return self.engine.settings.session_kv_dir

    def slots(self, model: str) -> int | None:
        try:
            spec = self.engine.registry.resolve(model).spec
        except ModelyardError:
            return None
        return slot_count(spec, self.engine.settings)

    async def act(self, model: str, slot: int, action: str, key: str) -> bool:
        """Restore (when the session has a saved file) or save `slot` of `model`'s server."""
        if action not in ACTIONS:
            raise InvalidRequest(f"slot action must be restore or save, not {action!r}",
                                 param="action")
        _check_key(key)
        spec = self.engine.registry.resolve(model).spec
        if not isinstance(spec, LlamaCppModel | OpenAIServerModel):
            return False
        upstream = upstream_of(self.engine.model_status(), model)
        if upstream is None:
            return False
        filename = f"{key}-{_model_version(spec)}.bin"
        if action == "restore" and not (self.directory / filename).is_file():
            return False
        if self._http is None:
            self._http = aiohttp.ClientSession()
        return await slot_action(self._http, upstream, slot, action, filename,
                                 self.engine.backend_key(model))

    def drop(self, key: str) -> None:
        _check_key(key)
        for path in self.directory.glob(f"{key}-*.bin"):
            with contextlib.suppress(OSError):
                path.unlink()

    async def close(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            await http.close()


def _check_key(key: str) -> None:
    """A session key is a hex digest (front/chat/sessions/kv.py `session_key`): never a path."""
    if not key or len(key) > 64 or any(c not in "0123456789abcdef" for c in key):
        raise InvalidRequest("a session key is a lowercase hex digest", param="key")


def upstream_of(model_status: list[dict[str, Any]], model: str) -> str | None:
    """The loopback URL of `model`'s server in an engine's model status, if it runs."""
    for m in model_status:
        if m["model"] == model and m["state"] == "ready":
            upstream = m.get("upstream")
            return str(upstream) if upstream else None
    return None
