"""Pure pieces of the server-side tool loop: opt-in detection, round rendering, config checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from modelyard.config import McpServer, Settings
from modelyard.front.chat.tools.loop import RoundEvent, mcp_servers_of, unknown_servers

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def settings(**extra: object) -> Settings:
    servers = [McpServer(id="time", command=["uvx", "mcp-server-time"]),
               McpServer(id="web", url="http://127.0.0.1:9/mcp")]  # fmt: skip
    return Settings(scan_hf_cache=False, mcp_servers=servers, **extra)


def test_opt_in_by_tools_entries_and_presets() -> None:
    s = settings(presets=[{"id": "agent", "model": "m", "mcp_servers": ["web"]}])
    fn = {"type": "function", "function": {"name": "f"}}
    assert mcp_servers_of({"model": "m", "tools": [fn]}, s) is None
    assert mcp_servers_of({"model": "m"}, s) is None
    tools = [fn, {"type": "mcp", "server": "time"}, {"type": "mcp", "servers": ["web", "time"]}]
    assert mcp_servers_of({"model": "m", "tools": tools}, s) == ["time", "web"]
    assert mcp_servers_of({"model": "agent"}, s) == ["web"]
    assert unknown_servers(["time", "nope"], s) == ["nope"]


def test_round_event_text_and_json() -> None:
    e = RoundEvent(1, "add", '{"a":2}')
    assert e.text() == '→ add({"a":2})\n'
    e.result = "5"
    assert e.text() == "← 5\n"
    assert e.to_json() == {"round": 1, "tool": "add", "arguments": '{"a":2}', "result": "5",
                           "is_error": False}  # fmt: skip
    e.result, e.is_error = "x" * 500, True
    assert e.text().startswith("← error: xxx") and e.text().endswith("…\n")


def test_config_refuses_bad_mcp_declarations() -> None:
    with pytest.raises(ValidationError, match="exactly one of `command` or `url`"):
        McpServer(id="x")
    with pytest.raises(ValidationError, match="exactly one"):
        McpServer(id="x", command=["a"], url="http://h")
    with pytest.raises(ValidationError, match=r"presets\[agent\]\.mcp_servers.*nope"):
        settings(presets=[{"id": "agent", "model": "m", "mcp_servers": ["nope"]}])
    with pytest.raises(ValidationError, match="unique"):
        Settings(mcp_servers=[McpServer(id="a", url="http://h"), McpServer(id="a", url="http://h")])
    assert settings().max_tool_rounds == 8
