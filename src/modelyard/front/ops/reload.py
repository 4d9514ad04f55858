"""Config reload: `POST /admin/reload`, SIGHUP and `modelyard reload`.

The front re-reads the config file it was started with (the environment still overrides it) and
validates it; an invalid file is refused with the field it trips on, and nothing changes. A valid
one becomes the front's settings and catalog, and every engine takes it up: a model whose spec
changed, or that is gone, stops once its requests in flight are done and the next request loads
the new spec; the others keep running. Settings a running server cannot change (bind address,
home, auth, devices…) keep their running values and are listed as `restart_required`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from modelyard.config import Settings, default_config_file, load_settings
from modelyard.errors import InvalidRequest, ModelyardError
from modelyard.front.catalog import Catalog
from modelyard.front.dispatch.dispatcher import Dispatcher
from modelyard.front.engines.client import EngineClient
from modelyard.front.ops.fronts import PEER_RELOAD
from modelyard.store.config_diff import diff_specs, keep_running, restart_required, spec_views
from modelyard.store.registry import ModelRegistry

log = logging.getLogger("modelyard.reload")

_BACKENDS = frozenset({"llamacpp", "openai", "service", "transformers"})


class ConfigReloader:
    def __init__(
        self, catalog: Catalog, dispatch: Dispatcher, config_file: Path | None
    ) -> None:
        self.catalog = catalog  # whose settings and models a reload replaces
        self.dispatch = dispatch  # what it remembers of the old ones, and the engines
        self.config_file = config_file
        self._lock = asyncio.Lock()  # one reload at a time
        self._tasks: set[asyncio.Task[Any]] = set()
        # Told after each reload this front made itself (not one it followed): several fronts
        # on one database follow it (front/ops/fronts.py `announce_reload`).
        self.announce: Callable[[], Awaitable[None]] | None = None
        # The file and environment as the server started with them, CLI flags left out: what a
        # restart-only setting is compared with (a flag such as --port is no change to report).
        try:
            self._started: Settings = load_settings(config_file)
        except (OSError, ValueError, yaml.YAMLError):
            self._started = catalog.settings

    def _path(self) -> Path:
        path = self.config_file or default_config_file()
        if path is None:
            raise InvalidRequest(
                "modelyard was started without a config file (--config, $MODELYARD_CONFIG or "
                "$MODELYARD_HOME/config.yaml): there is nothing to reload"
            )
        return path

    def _read(self) -> Settings:
        path = self._path()
        try:
            return load_settings(path)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = field_path(first["loc"])
            more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
            raise InvalidRequest(
                f"invalid config {path}: {where}: {first['msg']}{more}; the old config stays "
                "in force", param=where,
            ) from exc
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise InvalidRequest(
                f"invalid config {path}: {exc}; the old config stays in force"
            ) from exc

    async def reload(self, why: str = "POST /admin/reload") -> dict[str, Any]:
        """Apply the config file now, and log the outcome; raises InvalidRequest (nothing
        changed) if the file is not valid."""
        try:
            result = await self._reload()
        except ModelyardError as exc:
            log.error("config reload (%s) refused: %s", why, exc.message)
            raise
        summary = {k: v for k, v in result.items() if k not in ("status", "engines") and v}
        log.info("config reloaded (%s): %s", why, summary or "no change")
        if result["restart_required"]:
            log.warning("config reload (%s): these settings take effect only after a restart: "
                        "%s", why, ", ".join(result["restart_required"]))
        if self.announce is not None and why != PEER_RELOAD:
            try:
                await self.announce()
            except Exception:  # reloaded here; the other fronts follow at their next change
                log.exception("config reload (%s): telling the other fronts failed", why)
        return result

    async def _reload(self) -> dict[str, Any]:
        async with self._lock:
            catalog, dispatch = self.catalog, self.dispatch
            fresh = await asyncio.to_thread(self._read)
            settings = keep_running(fresh, catalog.settings)
            registry = await asyncio.to_thread(ModelRegistry.build, settings)
            diff = diff_specs(spec_views(catalog.registry, catalog.settings),
                              spec_views(registry, settings))
            catalog.settings, catalog.registry = settings, registry
            for model_id in [*diff.restart, *diff.updated]:
                dispatch.estimates.pop(model_id, None)
            for key in [k for k in dispatch.upstreams if k[1] in diff.restart]:
                del dispatch.upstreams[key]  # no early send to a server about to stop
            engines = await asyncio.gather(*(_reload_engine(e, settings)
                                             for e in dispatch.engines))
            await catalog.push()  # the new catalog: engines never build it from our database
            return {"status": "reloaded", **diff.to_json(),
                    "restart_required": restart_required(self._started, fresh),
                    "engines": engines}

    async def _on_signal(self) -> None:
        with contextlib.suppress(ModelyardError):  # logged; the old config stays in force
            await self.reload("SIGHUP")

    @contextlib.contextmanager
    def on_sighup(self) -> Iterator[None]:
        """While open, SIGHUP reloads the config (only where signals can be handled: the main
        thread of a Unix process)."""
        loop = asyncio.get_running_loop()

        def handle() -> None:
            task = loop.create_task(self._on_signal())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        try:
            loop.add_signal_handler(signal.SIGHUP, handle)
        except (AttributeError, NotImplementedError, RuntimeError, ValueError):
            yield  # not the main thread, or no SIGHUP here
            return
        try:
            yield
        finally:
            loop.remove_signal_handler(signal.SIGHUP)
            for task in list(self._tasks):
                task.cancel()


async def _reload_engine(engine: EngineClient, settings: Settings) -> dict[str, Any]:
    if not engine.up:
        # It reads the config file when its supervisor starts it again.
        return {"name": engine.name, "status": "down"}
    try:
        result = await engine.reload(settings)
    except ModelyardError as exc:
        log.error("%s did not take up the new config: %s", engine.name, exc.message)
        return {"name": engine.name, "status": "failed", "error": exc.message}
    return {"name": engine.name, "status": "reloaded", "restarting": result.get("restarting", [])}


def field_path(loc: tuple[int | str, ...]) -> str:
    """`models.2.ctx_size` for pydantic's ('models', 2, 'openai', 'ctx_size'): the backend tag
    of the model union is not part of the file."""
    parts = [str(p) for i, p in enumerate(loc)
             if not (p in _BACKENDS and i > 0 and isinstance(loc[i - 1], int))]
    return ".".join(parts) or "config"
