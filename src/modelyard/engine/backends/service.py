"""A registered HTTP service (TTS, STT, image, ComfyUI, another Ollama) that modelyard schedules
but does not run: it is "loaded" through its load route and "evicted" through its unload route,
like the consumers of mGPUmanager. Its health route tells whether it answers at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import aiohttp

from modelyard.config import ServiceModel, Settings
from modelyard.errors import ModelLoadFailed
from modelyard.placement.devices import Placement

_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=600)


class ServiceBackend:
    def __init__(self, spec: ServiceModel, settings: Settings) -> None:
        self.spec = spec
        self.settings = settings
        self.url = spec.url.rstrip("/")
        self.api_key: str | None = None  # a service modelyard does not start takes no key of ours
        self._gone = asyncio.Event()  # never set: a service modelyard does not run cannot exit
        self._log: list[str] = []

    @property
    def pid(self) -> int | None:
        return None

    def place(self, placement: Placement, env: Mapping[str, str]) -> None:
        self.placement: Placement | None = placement

    @property
    def alive(self) -> bool:
        return True

    def memory_bytes(self) -> int | None:
        return None

    def tail(self, lines: int) -> list[str]:
        return self._log[-lines:]

    async def _post(self, session: aiohttp.ClientSession, path: str) -> None:
        async with session.post(self.url + path) as r:
            body = await r.text()
            self._log.append(f"POST {path} -> {r.status} {body[:200]}")
            if r.status >= 400:
                raise ModelLoadFailed(
                    f"service '{self.spec.id}' answered {r.status} to POST {path}: {body[:200]}",
                    model=self.spec.id,
                    log_tail=self.tail(self.settings.log_tail_lines),
                )

    async def start(self, on_spawn: Callable[[int], None] | None = None) -> None:
        """Ask it to load, then wait until its health route answers 200 (bounded)."""
        try:
            async with aiohttp.ClientSession(timeout=_TIMEOUT) as session:
                if self.spec.load_path:
                    await self._post(session, self.spec.load_path)
                await self._wait_healthy(session)
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._log.append(f"{type(exc).__name__}: {exc}")
            raise ModelLoadFailed(
                f"service '{self.spec.id}' at {self.url} is unreachable ({type(exc).__name__})",
                model=self.spec.id,
                log_tail=self.tail(self.settings.log_tail_lines),
            ) from exc

    async def _wait_healthy(self, session: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.load_stall_timeout_s
        while True:
            try:
                async with session.get(self.url + self.spec.health_path) as r:
                    if r.status == 200:
                        return
                    last = f"health {r.status}"
            except aiohttp.ClientError as exc:
                last = f"health: {type(exc).__name__}"
            if loop.time() > deadline:
                raise ModelLoadFailed(
                    f"service '{self.spec.id}' not healthy after "
                    f"{self.settings.load_stall_timeout_s:.0f} s ({last})",
                    model=self.spec.id,
                )
            await asyncio.sleep(0.1)  # an external service: nothing to await but its answer

    async def stop(self) -> None:
        if not self.spec.unload_path:
            return
        async with aiohttp.ClientSession(timeout=_TIMEOUT) as session:
            await self._post(session, self.spec.unload_path)

    async def wait_exit(self) -> int | None:
        await self._gone.wait()
        return None
