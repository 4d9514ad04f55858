"""Live logs of the front, of each engine and of each model (admin; front/ops/logs.py reads them).

    GET /admin/logs?engine=&model=&after=&limit=
        {"source": name, "lines": [{"seq","ts","source","level","text"}], "next_after": seq,
         "sources": [{"name","kind": "front"|"engine"|"model","engine"}]}
        No engine nor model: the front's log; `engine=engine-0` (or `0`): that engine's;
        `model=<id or alias>`: that model's backend, as the engine it is loaded on (or the
        one `engine` names) serves it. Without `after`, the last `limit` lines;
        with it, the lines after that seq (oldest first, at most `limit`), `next_after` says
        where the next call goes on.
    GET /admin/logs/stream?engine=&model=&limit=&after=
        text/event-stream: `id: <seq>` + `data: <line>` per line, first the last `limit` lines
        (or those after `after` / the Last-Event-ID header), then each new line as it is
        written, until the client disconnects; a `: keepalive` comment when idle.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from modelyard.errors import InvalidRequest, ModelyardError, RouteNotFound
from modelyard.front.engines.client import EngineClient
from modelyard.front.ops.logs import FRONT, MAX_LIMIT, BufferLog, LogBuffer, LogLine
from modelyard.front.state import FrontState, state_of

log = logging.getLogger("modelyard.front.ops.logs")

DEFAULT_LIMIT = 200
KEEPALIVE_S = 15.0  # an idle stream says so this often: proxies keep it open, dead peers show


def log_buffer(request: Request) -> LogBuffer:
    return state_of(request).ops.logs


def _find_engine(state: FrontState, name: str) -> EngineClient:
    # `engine-0`, `0`, or a cluster engine's whole name (`n2/engine-0`)
    wanted = {name, f"engine-{name}"}
    for engine in state.dispatch.engines:
        if engine.name in wanted:
            return engine
    known = ", ".join(e.name for e in state.dispatch.engines) or "none"
    raise RouteNotFound(f"no engine '{name}' (engines: {known})", param="engine")


class _Source(Protocol):
    name: str

    async def read(self, after: int | None, limit: int) -> tuple[list[LogLine], int]: ...

    def follow(self, after: int) -> AsyncGenerator[list[LogLine], None]: ...


class _FrontLog:
    """This process's own records."""

    def __init__(self, buffer: LogBuffer) -> None:
        self.log = BufferLog(buffer, FRONT)
        self.name = FRONT

    async def read(self, after: int | None, limit: int) -> tuple[list[LogLine], int]:
        return self.log.read(after, limit)

    def follow(self, after: int) -> AsyncGenerator[list[LogLine], None]:
        return self.log.follow(after)


class _EngineLog:
    """An engine's own log (`model` None) or one of its models' backends', as the engine serves
    it: the front never opens an engine's files (DESIGN.md §3.11)."""

    def __init__(self, engine: EngineClient, model: str | None) -> None:
        self.engine = engine
        self.model = model
        self.name = model or engine.name

    async def read(self, after: int | None, limit: int) -> tuple[list[LogLine], int]:
        return await self.engine.read_log(self.model, after, limit)

    def follow(self, after: int) -> AsyncGenerator[list[LogLine], None]:
        return self.engine.follow_log(self.model, after)


async def _reader(request: Request) -> _Source:
    """The source the query names: a model's, an engine's, or the front's."""
    state = state_of(request)
    engine_name = request.query_params.get("engine")
    model = request.query_params.get("model")
    engine = _find_engine(state, engine_name) if engine_name else None
    if model:
        entry = state.catalog.registry.resolve(model)  # 404 model_not_found, naming it
        return _EngineLog(engine or await _engine_of(state, entry.id), entry.id)
    if engine is None:
        return _FrontLog(log_buffer(request))
    return _EngineLog(engine, None)


async def _engine_of(state: FrontState, model: str) -> EngineClient:
    """The engine whose log of `model` to read: where it is loaded, else the first one up."""
    found_model = (await state.dispatch.running_models()).get(model)
    where = found_model.engine if found_model is not None else None
    engines = state.dispatch.engines
    found = next((e for e in engines if e.name == where), None)
    found = found or next((e for e in engines if e.up), None) or next(iter(engines), None)
    if found is None:
        raise RouteNotFound(f"no engine serves the log of '{model}' (no engines)", param="model")
    return found


def _int(request: Request, name: str, default: int | None, lo: int, hi: int) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"`{name}` must be an integer, not {raw!r}", param=name) from None
    if not lo <= value <= hi:
        raise InvalidRequest(f"`{name}` must be between {lo} and {hi}", param=name)
    return value


def _after(request: Request) -> int | None:
    return _int(request, "after", None, 0, 2**62)


def _limit(request: Request) -> int:
    limit = _int(request, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
    assert limit is not None
    return limit


async def list_sources(state: FrontState) -> list[dict[str, Any]]:
    """The front, every engine, and every model in the catalog (with the engine it is loaded
    on, if any). Models served inside an engine (transformers) log into that engine's log."""
    sources: list[dict[str, Any]] = [{"name": FRONT, "kind": "front", "engine": None}]
    sources += [{"name": e.name, "kind": "engine", "engine": e.name, "up": e.up}
                for e in state.dispatch.engines]
    loaded = await state.dispatch.running_models()
    seen: set[str] = set()
    for entry in state.catalog.registry.entries():
        if entry.id in seen:
            continue
        seen.add(entry.id)
        running = loaded.get(entry.id)
        where = running.engine if running is not None else None
        sources.append({"name": entry.id, "kind": "model", "engine": where,
                        "backend": entry.spec.backend})
    return sources


def _json(payload: Any) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


async def read_logs(request: Request) -> Response:
    reader = await _reader(request)
    after, limit = _after(request), _limit(request)
    lines, cursor = await reader.read(after, limit)
    return _json({
        "source": reader.name,
        "lines": [line.to_json() for line in lines],
        "next_after": cursor,
        "sources": await list_sources(state_of(request)),
    })


def _events(lines: list[LogLine]) -> bytes:
    return b"".join(
        b"id: %d\ndata: %s\n\n" % (line.seq, orjson.dumps(line.to_json())) for line in lines
    )


async def stream_logs(request: Request) -> Response:
    reader = await _reader(request)  # an unknown source fails here, with a real 404
    after, limit = _after(request), _limit(request)
    if after is None and (last_id := request.headers.get("last-event-id", "")).isdigit():
        after = int(last_id)  # an EventSource reconnecting goes on where it stopped

    # Read before the response starts: an engine that cannot answer is a real 503.
    first = await reader.read(None, limit) if after is None else None

    async def events() -> AsyncIterator[bytes]:
        if first is not None:
            lines, cursor = first
            yield _events(lines) or b": no lines yet\n\n"  # headers go out now
        else:
            cursor = after or 0
            yield b": following\n\n"
        quiet_since = time.monotonic()
        # The follower yields at least every poll, so a client that left is noticed quickly
        # even on a silent log; closing it closes its file.
        async with contextlib.aclosing(reader.follow(cursor)) as batches:
            async for batch in _until_unavailable(batches):
                if await request.is_disconnected():
                    return
                now = time.monotonic()
                if batch:
                    yield _events(batch)
                    quiet_since = now
                elif now - quiet_since >= KEEPALIVE_S:
                    yield b": keepalive\n\n"
                    quiet_since = now

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


async def _until_unavailable(
    batches: AsyncGenerator[list[LogLine], None],
) -> AsyncIterator[list[LogLine]]:
    """An engine that goes away ends its log stream (the client reconnects with Last-Event-ID
    once it is back), without an error after the first byte."""
    try:
        async for batch in batches:
            yield batch
    except ModelyardError as exc:
        log.info("log stream ended: %s", exc.message)


routes = [
    Route("/admin/logs", read_logs, methods=["GET"]),
    Route("/admin/logs/stream", stream_logs, methods=["GET"]),
]
