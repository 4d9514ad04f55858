"""A child server that speaks the OpenAI API (llama-server, vLLM, TGI…): start, ready, stop.

The engine hands the front the server's URL (on the node address) and its per-load key with each
lease, so request bytes go from the front straight to the child; this class only owns the child's
lifecycle. The key (keys.py) reaches the child as `$api_key_file` (a private file, llama-server's
`--api-key-file`), as the environment variable `api_key_env` names (vLLM's VLLM_API_KEY), or as
`$api_key` in an argv template (readable in the process list: a last resort); a template that
uses none of them serves without a key, and its leases carry none.

A child can only be told a port number (llama-server takes no inherited socket), and a port free
when chosen may be taken before the child binds it: a child that exits saying so is started
once more on another port.
"""

from __future__ import annotations

import logging
import os
import string
from collections.abc import Callable, Mapping
from pathlib import Path

import aiohttp

from modelyard.config import LlamaCppModel, OpenAIServerModel, Settings
from modelyard.engine.backends.keys import key_file, new_key, remove_key_file, write_key_file
from modelyard.engine.backends.llamacpp import llama_server_argv, placement_values
from modelyard.errors import ModelLoadFailed
from modelyard.placement.devices import Placement
from modelyard.proc.ports import LOOPBACK, free_port
from modelyard.proc.process import ChildProcess
from modelyard.proc.readiness import NotReady, wait_ready
from modelyard.store.registry import served_name

log = logging.getLogger(__name__)

# What a child prints when its port was taken: llama-server; uvicorn and most others (EADDRINUSE).
PORT_TAKEN = ("couldn't bind http server socket", "address already in use")

__all__ = ["LOOPBACK", "ChildServer", "free_port", "log_path", "on_gpus", "render_argv",
           "url_host"]


def url_host(address: str) -> str:
    """`address` as a URL's host (an IPv6 address in brackets)."""
    return f"[{address}]" if ":" in address else address


def _uses(template: list[str], name: str) -> bool:
    return any(f"${name}" in a or f"${{{name}}}" in a for a in template)


def on_gpus(env: Mapping[str, str]) -> bool:
    """Whether a child with `env` runs on GPUs: the engine names them in CUDA_VISIBLE_DEVICES;
    a CPU engine (and a simulated device) hides every GPU with "" (or "-1")."""
    return env.get("CUDA_VISIBLE_DEVICES", "").strip() not in ("", "-1")


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
        self.host = settings.node_address
        self.port = free_port(self.host)
        self.url = f"http://{url_host(self.host)}:{self.port}"
        self._key = new_key()
        self.key_file = key_file(settings.home, _safe(spec.id))
        key_env = spec.api_key_env if isinstance(spec, OpenAIServerModel) else None
        if key_env:
            env = {**(env if env is not None else os.environ), key_env: self._key}
        # Rendered now without a placement, so a model that cannot run here (no llama-server
        # binary) fails before anything is evicted for it; again in place().
        argv = self._render(None)
        if any("$slot_dir" in arg for arg in self._template):
            settings.session_kv_dir.mkdir(parents=True, exist_ok=True)
        keyed = key_env or _uses(self._template, "api_key_file") or _uses(self._template, "api_key")
        self.api_key: str | None = self._key if keyed else None
        self.process = ChildProcess(
            argv,
            name=spec.id,
            log_file=log_path(settings, spec.id),
            env=env,
            log_max_bytes=settings.log_file_max_bytes,
            log_backups=settings.log_file_backups,
        )

    def _render(self, placement: Placement | None) -> list[str]:
        """The child's command line for `placement` (None: the engine's CPU, or not told)."""
        spec, settings = self.spec, self.settings
        if isinstance(spec, LlamaCppModel):
            template, values = llama_server_argv(spec, settings, placement)
        else:
            template = spec.argv + spec.extra_args
            ctx = spec.ctx_size or settings.default_ctx_size
            values = {"path": str(spec.path or ""), "id": served_name(spec.id), "ctx": str(ctx),
                      "slot_dir": str(settings.session_kv_dir), **placement_values(placement),
                      "tensor_parallel_size": str(len(placement.devices) if placement else 1)}
            template = template + self.placement_args(placement, template)
        self._template = template
        return render_argv(template, {**values, "host": self.host, "port": str(self.port),
                                      "api_key_file": str(self.key_file), "api_key": self._key})

    def placement_args(self, placement: Placement | None, argv: list[str]) -> list[str]:
        """Flags a kind of OpenAI server needs for a placement (vLLM: tensor parallel); none
        for an arbitrary server, which gets `$n_gpu_layers`… in its template instead."""
        return []

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def place(self, placement: Placement, env: Mapping[str, str]) -> None:
        """Merge `env` into the child's (the inherited environment stays: PATH, HOME…) and
        render its command line for `placement` when the child gets GPUs."""
        if env:
            base = self.process.env if self.process.env is not None else os.environ
            self.process.env = {**base, **env}
        self.placement = placement
        self._rerender()

    def _rerender(self) -> None:
        """The child's command line for its placement (when it gets GPUs) and port, now."""
        child_env = self.process.env if self.process.env is not None else os.environ
        placed = self.placement if on_gpus(child_env) else None
        self.process.argv = self._render(placed)

    @property
    def alive(self) -> bool:
        return self.process.alive

    def memory_bytes(self) -> int | None:
        return self.process.memory_bytes()

    def tail(self, lines: int) -> list[str]:
        return self.process.tail(lines)

    async def start(self, on_spawn: Callable[[int], None] | None = None) -> None:
        """Spawn the child and return when it is ready; ModelLoadFailed (child stopped) if not.
        A child whose port was taken meanwhile is started again on a new one (the module's
        docstring)."""
        try:
            await self._start_once(on_spawn)
        except ModelLoadFailed:
            if not self._lost_its_port():
                raise
            taken = self.port
            self._choose_port()
            log.warning("%s: port %d was taken before it could bind it; starting it on %d",
                        self.spec.id, taken, self.port)
            await self._start_once(on_spawn)

    def _lost_its_port(self) -> bool:
        if self.process.returncode is None:
            return False
        tail = "\n".join(self.process.tail(self.settings.log_tail_lines)).lower()
        return any(said in tail for said in PORT_TAKEN)

    def _choose_port(self) -> None:
        self.port = free_port(self.host)
        self.url = f"http://{url_host(self.host)}:{self.port}"
        self._rerender()

    async def _start_once(self, on_spawn: Callable[[int], None] | None) -> None:
        try:
            if _uses(self._template, "api_key_file"):
                write_key_file(self.key_file, self._key)
            await self.process.start()
        except OSError as exc:
            remove_key_file(self.key_file)
            raise ModelLoadFailed(
                f"could not start '{self.spec.id}': {exc}", model=self.spec.id
            ) from exc
        if on_spawn is not None and self.process.pid is not None:
            on_spawn(self.process.pid)
        timeout = aiohttp.ClientTimeout(total=2.0)
        # Unauthenticated: llama-server and vLLM answer their health route without the key.
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
        try:
            await self.process.stop(self.settings.stop_grace_s)
        finally:
            remove_key_file(self.key_file)  # the load is over: its key with it

    async def wait_exit(self) -> int | None:
        code = await self.process.wait()
        remove_key_file(self.key_file)
        return code


def _safe(model_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in model_id)


def log_path(settings: Settings, model_id: str) -> Path:
    return settings.logs_dir / "models" / f"{_safe(model_id)}.log"
