"""How the front talks to an engine process: `HttpEngineClient`, over its HTTP API and its lease
channel.

The rest of the front only sees `EngineClient` (wire/engines.py), so `--single-process` (its
client: front/engines/provider.py `LocalEngineClient`), engine subprocesses and (in a later step)
Ray actors are interchangeable. Releasing a lease never awaits, so it is safe in the `finally` of
a cancelled scope (client disconnect).

An engine process is called with its secret (DESIGN.md §3.12): `Authorization: Bearer` on its
HTTP API, a hello on its lease channel. Streams relayed from a model it granted are `watch`ed:
when the engine falls silent (no heartbeat on its lease channel) they end with an in-band
503 engine_unavailable, since nothing can account for their leases any more — a stopped engine
cannot release them, evict, or notice its model's server die, and is killed by the supervisor
unless it answers again first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import orjson
from pydantic import BaseModel

from modelyard.errors import EngineUnavailable, ModelyardError, from_native_body
from modelyard.front.dispatch.drain import Abortable
from modelyard.front.engines.catalog_feed import CatalogFeed
from modelyard.front.engines.lease_client import LeaseClient
from modelyard.serving import ENGINE_CLIENT_KEEPALIVE_S
from modelyard.types import Lease
from modelyard.wire.catalog import CatalogSnapshot
from modelyard.wire.doctor import EngineDoctor
from modelyard.wire.engines import EngineClient, SlotAction
from modelyard.wire.lease import Ticket
from modelyard.wire.logs import LogLine, LogSource

__all__ = ["ENGINE_RETRY_AFTER_S", "EngineClient", "HttpEngineClient"]
from modelyard.wire.status import EngineStatus

ENGINE_RETRY_AFTER_S = 2.0
# An engine's doctor report waits for torch's import in a child process (engine/doctor.py).
DOCTOR_TIMEOUT_S = 120.0

log = logging.getLogger("modelyard.front.engines.client")


class HttpEngineClient:
    """An engine process on a loopback port, usually started by the front's supervisor."""

    def __init__(self, name: str, index: int = 0, *, process_log: LogSource | None = None,
                 catalog: CatalogFeed | None = None) -> None:
        self.name = name
        self.index = index
        # The front's catalog, pushed to the engine each time it attaches (before it is up).
        self.catalog = catalog
        # The engine process's own output, read by whoever started it (its provider), so that
        # it can be read while the engine is down; None: the engine has no such log here.
        self.process_log = process_log
        self._session: aiohttp.ClientSession | None = None
        self._leases: LeaseClient | None = None
        # Where it answers while attached ("", 0: detached); a `serve --workers N` supervisor
        # tells its workers (front/engines/shared.py).
        self.address: tuple[str, int] = ("", 0)
        # False from a health probe (or a report) it did not answer in time until one it does:
        # calls then fail fast with 503 instead of hanging on a wedged engine.
        self._answering = True
        self._report_timeout: aiohttp.ClientTimeout | None = None
        self._relays: set[Abortable] = set()
        self._background: set[asyncio.Future[Any]] = set()  # session KV drops under way
        # Why it may never be attached (a protocol mismatch): what every call then raises.
        self._refused: ModelyardError | None = None

    @property
    def up(self) -> bool:
        return (self._answering and self._session is not None and self._leases is not None
                and not self._leases.closed and not self._leases.silent)

    def refuse(self, why: ModelyardError) -> None:
        """The supervisor will not attach this engine: calls raise `why` from now on."""
        self._refused = why

    def set_answering(self, answering: bool) -> None:
        """What the supervisor's last health probe found."""
        self._answering = answering

    async def attach(
        self,
        base_url: str,
        lease_port: int,
        secret: str,
        *,
        report_timeout_s: float | None = None,
        heartbeat_timeout_s: float = 0.0,
    ) -> None:
        """The supervisor says the engine answers at `base_url` and takes leases on `lease_port`
        for callers that know `secret`; its reports (status, diag) must come within
        `report_timeout_s`, and its lease channel must not be silent for `heartbeat_timeout_s`
        (0: no heartbeat)."""
        self._answering = True
        self._report_timeout = (
            aiohttp.ClientTimeout(total=report_timeout_s) if report_timeout_s else None
        )
        leases = await LeaseClient.connect(
            urlsplit(base_url).hostname or "127.0.0.1", lease_port, secret,
            heartbeat_timeout_s=heartbeat_timeout_s, name=self.name,
        )
        leases.on_silent = self._fell_silent
        # No overall timeout: a lease waits for a model load, which may take minutes; the
        # engine bounds that wait itself.
        session = aiohttp.ClientSession(
            base_url=base_url,
            headers={"Authorization": f"Bearer {secret}"},
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=ENGINE_CLIENT_KEEPALIVE_S),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )
        # The catalog first, while it is not up yet: no request reaches it with an older one.
        await self._push_catalog(session)
        self._leases, self._session = leases, session
        self.address = (base_url, lease_port)

    async def _push_catalog(self, session: aiohttp.ClientSession) -> None:
        snapshot = self.catalog.current if self.catalog is not None else None
        if snapshot is None:
            return  # the front's catalog is not made yet: it pushes it once it is
        try:
            async with session.post("/rescan", data=orjson.dumps(snapshot.to_json()),
                                    headers={"Content-Type": "application/json"}) as response:
                if response.status >= 400:
                    raise ModelyardError(f"{response.status}: {(await response.read())[:200]!r}")
        except (aiohttp.ClientError, TimeoutError, ModelyardError) as exc:
            # It serves what it read itself (a local engine) until the next push; the log says.
            log.error("%s did not take the front's catalog: %s", self.name, exc)

    def watch(self, relay: Abortable) -> Callable[[], None]:
        self._relays.add(relay)
        return lambda: self._relays.discard(relay)

    def abort_relays(self, why: str) -> None:
        """End the streams this engine granted, in-band: it is gone (its node left, say)."""
        relays, self._relays = self._relays, set()
        for relay in relays:
            relay.abort(self._unavailable(why))

    def _fell_silent(self) -> None:
        """End the streams this engine granted, in-band (see the module's docstring)."""
        relays, self._relays = self._relays, set()
        if relays:
            log.error("%s is silent: ending its %d stream(s) in flight", self.name, len(relays))
        for relay in relays:
            relay.abort(self._unavailable("it stopped answering its lease channel"))

    async def detach(self) -> None:
        """The engine went away; requests get 503 engine_unavailable until it is back."""
        session, self._session = self._session, None
        leases, self._leases = self._leases, None
        self.address = ("", 0)
        if leases is not None:
            await leases.close()
        if session is not None:
            await session.close()

    def _check_up(self) -> None:
        """Fail fast, with the reason, while the engine is known not to answer."""
        if self._refused is not None:
            raise self._refused
        if self._session is None or self._leases is None or self._leases.closed:
            raise self._unavailable("down")
        if not self._answering:
            raise self._unavailable("not answering its health probe")
        if self._leases.silent:
            raise self._unavailable("silent on its lease channel")

    def _unavailable(self, why: str) -> EngineUnavailable:
        return EngineUnavailable(
            f"{self.name} is not available ({why}); one that does not recover is restarted",
            retry_after_s=ENGINE_RETRY_AFTER_S,
        )

    async def _call(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        """The engine's JSON answer, or the ModelyardError it sent."""
        session = self._session
        self._check_up()
        assert session is not None
        data = orjson.dumps(body) if body is not None else None
        # The engine takes only JSON (a page in a browser can POST text/plain to a loopback port).
        headers = {"Content-Type": "application/json"} if method == "POST" else None
        try:
            async with session.request(method, path, data=data, headers=headers,
                                       **kw) as response:
                content = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            if isinstance(exc, TimeoutError):
                self._answering = False  # until the next health probe it answers
            raise self._unavailable(type(exc).__name__) from exc
        payload = orjson.loads(content) if content else None
        if status >= 400:
            if isinstance(payload, dict) and "error" in payload:
                raise from_native_body(payload)
            raise ModelyardError(f"engine answered {status}: {content[:200]!r}")
        return payload

    async def acquire(
        self,
        model: str,
        keep_alive_s: float | None = None,
        on_progress: Callable[[str], None] | None = None,
        queue: Ticket | None = None,
    ) -> Lease:
        self._check_up()
        assert self._leases is not None
        return await self._leases.acquire(model, keep_alive_s, on_progress, queue)

    async def load(self, model: str, keep_alive_s: float | None = None) -> dict[str, Any]:
        query = {"keep_alive_s": str(keep_alive_s)} if keep_alive_s is not None else None
        path = f"/models/{quote(model, safe='')}/load"
        return dict(await self._call("POST", path, params=query))

    async def unload(self, model: str) -> dict[str, Any]:
        return dict(await self._call("POST", f"/models/{quote(model, safe='')}/unload"))

    async def rescan(self, catalog: CatalogSnapshot | None = None) -> None:
        await self._call("POST", "/rescan", catalog.to_json() if catalog is not None else None)

    async def reload(self, settings: BaseModel) -> dict[str, Any]:
        return dict(await self._call("POST", "/reload", settings.model_dump(mode="json")))

    def lease_now(self, model: str, keep_alive_s: float | None = None) -> Lease | None:
        leases = self._leases
        if leases is None or not self.up:
            return None
        return leases.kept_lease(model, keep_alive_s)

    def release(self, lease: Lease, *, keep: bool = True) -> None:
        # An engine that restarted has forgotten the lease already; nothing to do then.
        if self._leases is not None:
            self._leases.give_back(lease, keep=keep)

    async def status(self) -> EngineStatus:
        return EngineStatus.from_json(
            await self._call("GET", "/status", timeout=self._report_timeout))

    def latest_status(self) -> EngineStatus | None:
        """The status the engine pushed on its lease channel (no round trip), while it is up;
        None: ask `status()`."""
        leases = self._leases
        return leases.latest_status() if self.up and leases is not None else None

    async def diag(self) -> dict[str, Any]:
        return dict(await self._call("GET", "/diag", timeout=self._report_timeout))

    async def doctor(self) -> EngineDoctor:
        # Not the report timeout: the engine imports torch in a child process to answer.
        return EngineDoctor.model_validate(await self._call(
            "GET", "/doctor", timeout=aiohttp.ClientTimeout(total=DOCTOR_TIMEOUT_S)))

    async def read_log(
        self, model: str | None, after: int | None, limit: int
    ) -> tuple[list[LogLine], int]:
        if model is None:
            if self.process_log is None:
                return [], 0
            return await asyncio.to_thread(self.process_log.read, after, limit)
        params = {"model": model, "limit": str(limit)}
        if after is not None:
            params["after"] = str(after)
        body = await self._call("GET", "/logs", params=params, timeout=self._report_timeout)
        return [LogLine.from_json(x) for x in body["lines"]], int(body["next_after"])

    async def follow_log(
        self, model: str | None, after: int
    ) -> AsyncGenerator[list[LogLine], None]:
        if model is None:
            if self.process_log is None:
                return
            async with contextlib.aclosing(self.process_log.follow(after)) as batches:
                async for batch in batches:
                    yield batch
            return
        session = self._session
        self._check_up()
        assert session is not None
        params = {"model": model, "after": str(after)}
        try:
            async with session.get("/logs/stream", params=params) as response:
                if response.status >= 400:
                    payload = orjson.loads(await response.read() or b"null")
                    if isinstance(payload, dict) and "error" in payload:
                        raise from_native_body(payload)
                    raise ModelyardError(f"engine answered {response.status}")
                pending = b""
                async for chunk in response.content.iter_any():
                    pending += chunk
                    if b"\n" not in chunk:
                        continue  # a big batch comes in many chunks: split once it is whole
                    *complete, pending = pending.split(b"\n")
                    for raw in complete:
                        yield [LogLine.from_json(x) for x in orjson.loads(raw)["lines"]]
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._unavailable(type(exc).__name__) from exc

    async def kv_slots(self, model: str) -> int | None:
        body = await self._call("GET", f"/kv/{quote(model, safe='')}/slots")
        slots = body.get("slots")
        return int(slots) if slots is not None else None

    async def kv_slot(self, model: str, slot: int, action: SlotAction, key: str) -> bool:
        body = await self._call("POST", f"/kv/{quote(model, safe='')}/slots/{int(slot)}",
                                {"action": action, "key": key})
        return bool(body.get("ok"))

    def kv_drop(self, key: str) -> None:
        if not self.up:
            return  # its files stay: a later drop of the same session cannot name them
        task = asyncio.ensure_future(self._call("POST", "/kv/drop", {"key": key}))
        self._background.add(task)
        task.add_done_callback(self._dropped)

    def _dropped(self, task: asyncio.Future[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.info("%s: dropping a session's saved KV failed: %s", self.name, exc)
