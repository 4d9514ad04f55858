"""Connections to the MCP servers declared in `mcp_servers`, for the server-side tool loop.

One `McpHub` per front. Each server is connected lazily, on first use, by a task of its own
that owns the transport and the `mcp.ClientSession` (their context managers must be entered and
left in one task); callers share the session. Nothing here raises into the loop: a server that
does not start, a tool that fails (`isError`), a call past `tool_timeout_s` all come back as a
`ToolResult` with `is_error` set and a text the model can read. A server that died is connected
again on the next use. `close()` (front shutdown) ends every connection, which stops stdio
servers (the SDK terminates the child's process tree).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from modelyard.config import McpServer

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class McpTool:
    server: str
    name: str
    description: str
    input_schema: dict[str, Any]


@dataclass(frozen=True)
class ToolResult:
    text: str
    is_error: bool


class _Connection:
    """One server's session, owned by one task: `session()` connects (once), `close()` ends."""

    def __init__(self, spec: McpServer) -> None:
        self.spec = spec
        self._task: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[ClientSession] | None = None
        self._stop = asyncio.Event()

    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def session(self) -> ClientSession:
        if not self.alive():
            loop = asyncio.get_running_loop()
            self._ready, self._stop = loop.create_future(), asyncio.Event()
            self._task = asyncio.create_task(self._own(self._ready, self._stop))
        assert self._ready is not None
        return await asyncio.wait_for(asyncio.shield(self._ready), CONNECT_TIMEOUT_S)

    async def _own(self, ready: asyncio.Future[ClientSession], stop: asyncio.Event) -> None:
        spec = self.spec
        try:
            if spec.command is not None:
                params = StdioServerParameters(
                    command=spec.command[0], args=spec.command[1:], env=spec.env or None,
                    cwd=str(spec.cwd) if spec.cwd else None,
                )
                transport: Any = stdio_client(params)
            else:
                assert spec.url is not None
                transport = _http_transport(spec.url, spec.headers)
            async with contextlib.AsyncExitStack() as stack:
                streams = await stack.enter_async_context(transport)
                session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await session.initialize()
                ready.set_result(session)
                await stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(
                    McpUnavailable(f"MCP server '{spec.id}' is unavailable: {_describe(exc)}")
                )
            if not isinstance(exc, Exception):
                raise
            log.warning("MCP server '%s' connection ended: %s", spec.id, _describe(exc))

    async def close(self) -> None:
        self._stop.set()
        task, self._task = self._task, None
        if task is not None:
            try:
                await asyncio.wait_for(task, 10)
            except (TimeoutError, asyncio.CancelledError, Exception):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task


class McpUnavailable(Exception):
    pass


def _http_transport(url: str, headers: dict[str, str]) -> Any:
    if not headers:
        return streamable_http_client(url)
    import httpx2  # the SDK's HTTP client (a dependency of `mcp`)

    return streamable_http_client(url, http_client=httpx2.AsyncClient(headers=headers))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class McpHub:
    def __init__(self, servers: list[McpServer]) -> None:
        self.specs = {s.id: s for s in servers}
        self._conns: dict[str, _Connection] = {}
        self._tools: dict[str, list[McpTool]] = {}

    def _conn(self, server: str) -> _Connection:
        if server not in self.specs:  # declared by a reload: the hub is the startup one's
            raise McpUnavailable(f"MCP server '{server}' needs a restart to be used")
        if server not in self._conns:
            self._conns[server] = _Connection(self.specs[server])
        return self._conns[server]

    async def list_tools(self, server: str) -> list[McpTool]:
        """The server's tools (filtered by `allowed_tools`); raises McpUnavailable."""
        conn = self._conn(server)  # may raise McpUnavailable
        if server in self._tools and conn.alive():
            return self._tools[server]
        try:
            session = await conn.session()
            listed = await asyncio.wait_for(session.list_tools(), CONNECT_TIMEOUT_S)
        except McpUnavailable:
            raise
        except Exception as exc:
            await conn.close()
            raise McpUnavailable(f"MCP server '{server}': {_describe(exc)}") from exc
        allowed = conn.spec.allowed_tools
        tools = [
            McpTool(server, t.name, t.description or "", dict(t.input_schema or {}))
            for t in listed.tools
            if allowed is None or t.name in allowed
        ]
        self._tools[server] = tools
        return tools

    async def call(self, server: str, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Run one tool call; every failure is an error result, never an exception (but
        cancellation, which goes through)."""
        try:
            conn = self._conn(server)
        except McpUnavailable as exc:
            return ToolResult(f"error: {exc}", True)
        spec = conn.spec
        if spec.allowed_tools is not None and name not in spec.allowed_tools:
            return ToolResult(f"tool '{name}' is not allowed on MCP server '{server}'", True)
        try:
            session = await conn.session()
            result = await asyncio.wait_for(
                session.call_tool(name, arguments), spec.tool_timeout_s
            )
        except TimeoutError:
            return ToolResult(
                f"error: tool '{name}' timed out after {spec.tool_timeout_s:g} s", True
            )
        except McpUnavailable as exc:
            return ToolResult(f"error: {exc}", True)
        except Exception as exc:
            if not conn.alive():
                await conn.close()  # reconnect on the next call
            return ToolResult(f"error: tool '{name}' failed: {_describe(exc)}", True)
        return ToolResult(_result_text(result), bool(result.is_error))

    async def close(self) -> None:
        conns, self._conns = list(self._conns.values()), {}
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)


def _result_text(result: Any) -> str:
    parts: list[str] = []
    for item in result.content or []:
        text = getattr(item, "text", None)
        parts.append(text if isinstance(text, str) else json.dumps(item.model_dump(mode="json")))
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)
