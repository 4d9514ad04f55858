"""A real MCP server for the tool-loop tests, over stdio (the official `mcp` package).

    python tests/fakes/mcp_server.py [--start-log FILE]

Tools: `add(a, b)` returns a + b (deterministic), `boom()` raises (an `isError` result),
`hang()` never returns (it awaits an event nobody sets). With --start-log, appends `start <pid>`
to FILE at startup, so a test can tell how many servers were spawned and find them.
"""

from __future__ import annotations

import asyncio
import os
import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("modelyard-test")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def boom() -> str:
    """Always fails."""
    raise ToolError("boom: the tool failed on purpose")


@server.tool()
async def hang() -> str:
    """Never returns."""
    await asyncio.Event().wait()
    return "unreachable"


def main() -> None:
    if "--start-log" in sys.argv:
        with open(sys.argv[sys.argv.index("--start-log") + 1], "a") as f:
            f.write(f"start {os.getpid()}\n")
    server.run("stdio")


if __name__ == "__main__":
    main()
