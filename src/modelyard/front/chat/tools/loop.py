"""The server-side tool loop: run the model, execute its MCP tool calls, resume, until it answers.

A chat opts in with a `tools` entry `{"type": "mcp", "server": ID}` (or `"servers": [...]`), or
through a preset whose `mcp_servers` names servers. Those entries are replaced by the servers'
tools as OpenAI function tools (named as the server names them; a name two servers share becomes
`SERVER__NAME`); the client's own function tools may sit beside them.

Each round is one ordinary relay through `Dispatcher.open_relay` (queue slot, lease), asked
non-streaming and read whole; the relay is closed -- the lease released -- before any tool runs,
so the scheduler serves others while a tool works. The calls of one answer run concurrently. The
loop ends at an answer without tool calls, at a call of a client tool (that answer goes back to
the client as an ordinary tool_calls answer), or when `max_tool_rounds` rounds of tools have run
and the model still asks for more: then the answer is a note saying so, finish_reason "length".
In a chat session, the turn stored is the whole exchange: the assistant's tool calls and the tool
results of every round, then the answer; an archived chat's transcript is that exchange too.
Every round is reported as it happens (`RoundEvent`); a cancelled loop (the client left) cancels
the tool call in progress, and no lease is held by then.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from modelyard.config import Settings
from modelyard.errors import UpstreamError
from modelyard.front.chat.tools.mcp import McpHub, McpUnavailable, ToolResult
from modelyard.front.dispatch.relay import Relay

if TYPE_CHECKING:
    from modelyard.front.archive.capture import ChatCapture
    from modelyard.front.chat.sessions.store import Turn

SUMMARY_CHARS = 200  # a tool result is shown to the client up to this long


def mcp_servers_of(data: dict[str, Any], settings: Settings) -> list[str] | None:
    """The MCP servers a chat request enables (its `tools` entries, its preset), or None."""
    found: list[str] = []
    for tool in data.get("tools") or []:
        if isinstance(tool, dict) and tool.get("type") == "mcp":
            if isinstance(tool.get("server"), str):
                found.append(tool["server"])
            found += [s for s in tool.get("servers") or [] if isinstance(s, str)]
    model = data.get("model")
    for preset in settings.presets:
        if preset.id == model:
            found += preset.mcp_servers
    return list(dict.fromkeys(found)) or None


def unknown_servers(servers: list[str], settings: Settings) -> list[str]:
    known = {s.id for s in settings.mcp_servers}
    return [s for s in servers if s not in known]


@dataclass
class RoundEvent:
    """One tool call of round `round`: `result` is None while it runs."""

    round: int
    tool: str
    arguments: str
    result: str | None = None
    is_error: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "tool": self.tool, "arguments": self.arguments,
                "result": self.result, "is_error": self.is_error}  # fmt: skip

    def text(self) -> str:
        """What a reasoning-rendering client shows: `→ add({...})`, then `← 5`."""
        if self.result is None:
            return f"→ {self.tool}({self.arguments})\n"
        summary = self.result if len(self.result) <= SUMMARY_CHARS else (
            self.result[:SUMMARY_CHARS] + "…")
        flag = "error: " if self.is_error and not summary.startswith("error") else ""
        return f"← {flag}{summary}\n"


@dataclass
class Final:
    """The answer: the upstream chat completion (JSON), or its error (status != 200)."""

    status: int
    body: dict[str, Any] | bytes
    trace: list[dict[str, Any]] = field(default_factory=list)


OpenRound = Callable[[bytes], Any]  # payload -> Awaitable[Relay]


# Told the whole conversation (rounds included) and the answer, before the client sees the end.
OnAnswer = Callable[[list[dict[str, Any]], dict[str, Any]], None]


class ToolLoop:
    def __init__(self, hub: McpHub, settings: Settings, data: dict[str, Any],
                 servers: list[str]) -> None:  # fmt: skip
        self.hub, self.settings, self.data, self.servers = hub, settings, data, servers
        self.routes: dict[str, tuple[str, str]] = {}  # offered name -> (server, tool name)
        self.on_answer: list[OnAnswer] = []  # a chat session stores the turn, the archive saves
        self.turn: Turn | None = None  # that session's turn (front/chat/sessions/relay.py)
        self.capture: ChatCapture | None = None  # the transcript to archive, when asked
        self.messages: list[dict[str, Any]] = []  # the conversation so far, rounds included

    async def tools(self) -> list[dict[str, Any]]:
        """The request's tools with the MCP entries replaced by the servers' function tools."""
        listed = []
        for server in self.servers:
            try:
                listed += await self.hub.list_tools(server)
            except McpUnavailable as exc:
                raise UpstreamError(str(exc)) from exc
        counts: dict[str, int] = {}
        for t in listed:
            counts[t.name] = counts.get(t.name, 0) + 1
        offered = []
        for t in listed:
            name = t.name if counts[t.name] == 1 else f"{t.server}__{t.name}"
            self.routes[name] = (t.server, t.name)
            schema = t.input_schema or {"type": "object", "properties": {}}
            fn = {"name": name, "description": t.description, "parameters": schema}
            offered.append({"type": "function", "function": fn})
        own = [t for t in self.data.get("tools") or []
               if not (isinstance(t, dict) and t.get("type") == "mcp")]  # fmt: skip
        return [*own, *offered]

    async def run(self, open_round: OpenRound) -> AsyncGenerator[RoundEvent | Final, None]:
        body = {k: v for k, v in self.data.items() if k not in ("stream", "stream_options")}
        body["tools"] = await self.tools()
        messages = self.messages = list(body.get("messages") or [])
        trace: list[dict[str, Any]] = []
        rounds = 0
        while True:
            relay: Relay = await open_round(orjson.dumps({**body, "messages": messages}))
            # Closes the relay: the engine has its lease back while tools run (none kept for a
            # next round that comes only after them).
            raw = await relay.read(keep_lease=False)
            if relay.status != 200:
                yield Final(relay.status, raw, trace)
                return
            answer = orjson.loads(raw)
            choice = (answer.get("choices") or [{}])[0]
            message = choice.get("message") or {}
            calls = message.get("tool_calls") or []
            if not calls or any(_name(c) not in self.routes for c in calls):
                self._answered(messages, answer)
                yield Final(200, answer, trace)  # an answer, or a client tool's call
                return
            if rounds >= self.settings.max_tool_rounds:
                note = (f"[modelyard] stopped: the model still called tools after {rounds} "
                        f"tool rounds (max_tool_rounds)")  # fmt: skip
                choice["message"] = {"role": "assistant", "content": note}
                choice["finish_reason"] = "length"
                self._answered(messages, answer)
                yield Final(200, answer, trace)
                return
            rounds += 1
            events = [RoundEvent(rounds, _name(c), _arguments(c)) for c in calls]
            for event in events:
                yield event
            messages.append({"role": "assistant", "content": message.get("content"),
                             "tool_calls": calls})  # fmt: skip
            results = await asyncio.gather(*(self._call(e) for e in events))
            for call, event, result in zip(calls, events, results, strict=True):
                event.result, event.is_error = result.text, result.is_error
                trace.append(event.to_json())
                yield event
                messages.append(
                    {"role": "tool", "tool_call_id": call.get("id", ""), "content": result.text}
                )

    def _answered(self, messages: list[dict[str, Any]], answer: dict[str, Any]) -> None:
        for listener in self.on_answer:
            listener(messages, answer)

    async def _call(self, event: RoundEvent) -> ToolResult:
        server, tool = self.routes[event.tool]
        try:
            arguments = json.loads(event.arguments or "{}")
        except ValueError:
            return ToolResult(f"error: the arguments are not JSON: {event.arguments[:200]}", True)
        if not isinstance(arguments, dict):
            return ToolResult("error: the arguments must be a JSON object", True)
        return await self.hub.call(server, tool, arguments)


def _name(call: dict[str, Any]) -> str:
    return str((call.get("function") or {}).get("name", ""))


def _arguments(call: dict[str, Any]) -> str:
    args = (call.get("function") or {}).get("arguments")
    return args if isinstance(args, str) else json.dumps(args or {})
