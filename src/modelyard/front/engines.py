"""How the front talks to engines: one interface, an in-process and an HTTP implementation.

The rest of the front only sees `EngineClient`, so `--single-process`, engine subprocesses and (in
a later step) Ray actors are interchangeable. Releasing a lease never blocks the response: it is
scheduled as a task, which also makes it safe from a cancelled scope (client disconnect).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

import httpx
import orjson

from modelyard.engine.loop import Engine, Lease
from modelyard.errors import EngineUnavailable, ModelyardError, from_native_body

ENGINE_RETRY_AFTER_S = 2.0


class EngineClient(Protocol):
    name: str

    @property
    def up(self) -> bool: ...

    async def acquire(self, model: str) -> Lease: ...

    def release(self, lease: Lease) -> None: ...

    async def status(self) -> dict[str, Any]: ...

    async def diag(self) -> dict[str, Any]: ...

    async def unload(self, model: str) -> bool: ...

    async def logs(self, model: str, lines: int) -> list[str]: ...


class LocalEngineClient:
    """The engine lives in this process (`--single-process`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.name = f"engine-{engine.index}"

    @property
    def up(self) -> bool:
        return True

    async def acquire(self, model: str) -> Lease:
        return await self.engine.acquire(model)

    def release(self, lease: Lease) -> None:
        self.engine.release(lease.id)

    async def status(self) -> dict[str, Any]:
        return self.engine.status()

    async def diag(self) -> dict[str, Any]:
        from modelyard.hw.devices import describe_devices

        return {"engine": self.engine.index, "devices": describe_devices()}

    async def unload(self, model: str) -> bool:
        return await self.engine.unload(model, drain_timeout_s=60)

    async def logs(self, model: str, lines: int) -> list[str]:
        return self.engine.logs(model, lines)


class HttpEngineClient:
    """An engine process on a loopback port, usually started by the front's supervisor."""

    def __init__(self, name: str, base_url: str | None = None) -> None:
        self.name = name
        self.base_url = base_url
        self._ready = False
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def up(self) -> bool:
        return self._ready and self._client is not None

    def attach(self, base_url: str) -> None:
        """The supervisor says the engine answers at `base_url`."""
        self.base_url = base_url
        self._client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(connect=5.0, read=None, write=10.0, pool=10.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=64),
        )
        self._ready = True

    async def detach(self) -> None:
        """The engine went away; requests get 503 engine_unavailable until it is back."""
        self._ready = False
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def _unavailable(self, why: str) -> EngineUnavailable:
        return EngineUnavailable(
            f"{self.name} is not available ({why}); it is being restarted",
            retry_after_s=ENGINE_RETRY_AFTER_S,
        )

    async def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        client = self._client
        if not self._ready or client is None:
            raise self._unavailable("down")
        try:
            response = await client.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise self._unavailable(type(exc).__name__) from exc
        if response.status_code >= 400:
            raise _engine_error(response)
        return response

    async def acquire(self, model: str) -> Lease:
        r = await self._call("POST", "/leases", content=orjson.dumps({"model": model}))
        data = orjson.loads(r.content)
        return Lease(
            id=data["lease_id"],
            model=data["model"],
            upstream=data["upstream"],
            load_duration_ns=data["load_duration_ns"],
        )

    def release(self, lease: Lease) -> None:
        task = asyncio.get_running_loop().create_task(self._release(lease))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, lease: Lease) -> None:
        # An engine that restarted has forgotten the lease already; nothing to do.
        with contextlib.suppress(ModelyardError):
            await self._call("DELETE", f"/leases/{lease.id}")

    async def status(self) -> dict[str, Any]:
        return dict((await self._call("GET", "/status")).json())

    async def diag(self) -> dict[str, Any]:
        return dict((await self._call("GET", "/diag")).json())

    async def unload(self, model: str) -> bool:
        r = await self._call("POST", f"/models/{model}/unload", timeout=120.0)
        return bool(r.json().get("unloaded"))

    async def logs(self, model: str, lines: int) -> list[str]:
        r = await self._call("GET", f"/models/{model}/logs", params={"lines": lines})
        return list(r.json().get("lines", []))


def _engine_error(response: httpx.Response) -> ModelyardError:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "error" in body:
        return from_native_body(body)
    return ModelyardError(f"engine answered {response.status_code}: {response.text[:200]}")
