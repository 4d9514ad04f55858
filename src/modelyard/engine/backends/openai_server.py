"""A child server that speaks the OpenAI API (llama-server, vLLM, TGI…): start, ready, stop.

The engine hands the front the server's loopback URL with each lease, so request bytes go from the
front straight to the child; this class only owns the child's lifecycle.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping
from pathlib import Path

import aiohttp

from modelyard.config import LlamaCppModel, OpenAIServerModel, Settings
from modelyard.engine.backends.llamacpp import llama_server_argv
from modelyard.errors import ModelLoadFailed
from modelyard.placement.devices import Placement
from modelyard.proc.ports import LOOPBACK, free_port
from modelyard.proc.process import ChildProcess
from modelyard.proc.readiness import NotReady, wait_ready
from modelyard.store.registry import served_name

__all__ = ["LOOPBACK", "ChildServer", "free_port", "log_path", "render_argv"]


def render_argv(template: list[str], values: Mapping[str, str]) -> list[str]:
    return [string.Template(arg).safe_substitute(values) for arg in template]


class ChildServer:
    def __init__(
        self,
        spec: LlamaCppModel | OpenAIServerModel,
        settings: Settings,
        *,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.settings = settings
        self.placement: Placement | None = None  # told by the engine before start()
        if isinstance(spec, LlamaCppModel):
            template, values = llama_server_argv(spec, settings)
        else:
            template = spec.argv + spec.extra_args
            ctx = spec.ctx_size or settings.default_ctx_size
            values = {"path": str(spec.path or ""), "id": served_name(spec.id), "ctx": str(ctx),
                      "slot_dir": str(settings.session_kv_dir)}
        if any("$slot_dir" in arg for arg in template):
            settings.session_kv_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        argv = render_argv(template, {**values, "host": LOOPBACK, "port": str(self.port)})
        self.process = ChildProcess(
            argv,
            name=spec.id,
            log_file=log_path(settings, spec.id),
            env=env,
            log_max_bytes=settings.log_file_max_bytes,
            log_backups=settings.log_file_backups,
        )

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def place(self, placement: Placement, env: Mapping[str, str]) -> None:
        self.placement = placement
        self.process.env = {**(self.process.env or {}), **env} if env else self.process.env

    @property
    def alive(self) -> bool:
        return self.process.alive

    def memory_bytes(self) -> int | None:
        return self.process.memory_bytes()

    def tail(self, lines: int) -> list[str]:
        return self.process.tail(lines)

    async def start(self, on_spawn: Callable[[int], None] | None = None) -> None:
        """Spawn the child and return when it is ready; ModelLoadFailed (child stopped) if not."""
        try:
            await self.process.start()
        except OSError as exc:
            raise ModelLoadFailed(
                f"could not start '{self.spec.id}': {exc}", model=self.spec.id
            ) from exc
        if on_spawn is not None and self.process.pid is not None:
            on_spawn(self.process.pid)
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(self.url, timeout=timeout) as session:

            async def probe() -> bool:
                try:
                    async with session.get(self.spec.health_path) as r:
                        return r.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    return False

            try:
                await wait_ready(
                    probe=probe,
                    exit_code=lambda: self.process.returncode,
                    progress=self.process.output_bytes,
                    stall_timeout_s=self.settings.load_stall_timeout_s,
                    total_timeout_s=self.settings.load_timeout_s,
                    # What a cold request waits, at most, once the server is really ready
                    # (it is usually less: its "listening" line is probed at once).
                    poll_interval_s=0.01,
                    watch_interval_s=0.002,
                )
            except NotReady as exc:
                await self.stop()
                raise ModelLoadFailed(
                    f"model '{self.spec.id}' failed to load: {exc}",
                    model=self.spec.id,
                    log_tail=self.process.tail(self.settings.log_tail_lines),
                ) from exc
            except BaseException:
                await self.stop()
                raise

    async def stop(self) -> None:
        await self.process.stop(self.settings.stop_grace_s)

    async def wait_exit(self) -> int | None:
        return await self.process.wait()


def _safe(model_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in model_id)


def log_path(settings: Settings, model_id: str) -> Path:
    return settings.logs_dir / "models" / f"{_safe(model_id)}.log"
