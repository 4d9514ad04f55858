"""The server-side tool loop over a real MCP server (tests/fakes/mcp_server.py, stdio) and the
fake llama-server's deterministic tool-call mode, through a real `modelyard serve`."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.harness import config, model_status, module_server, pid_alive
from tests.support import Server, fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

MCP_SERVER = Path(__file__).resolve().parents[1] / "fakes" / "mcp_server.py"
MCP = {"type": "mcp", "server": "test"}
ROUNDS = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    models = [fake_model(m, max_concurrency=1) for m in ("t1", "t-hang", "t-cancel", "t-base")]
    mcp = {"id": "test", "command": [sys.executable, str(MCP_SERVER)], "tool_timeout_s": 2}
    presets = [{"id": "agent", "model": "t-base", "mcp_servers": ["test"]}]
    cfg = config(*models, mcp_servers=[mcp], max_tool_rounds=ROUNDS, presets=presets)
    with module_server(tmp_path_factory, cfg) as s:
        yield s


def chat(model: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "tools": [MCP],
            **extra}  # fmt: skip


def post(server: Server, body: Any) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


def archived(server: Server, item_id: str) -> dict[str, Any]:
    """The archive item, once saved (it is saved in the background)."""

    def saved() -> dict[str, Any] | None:
        got = httpx.get(f"{server.url}/archive/{item_id}", headers=server.admin_headers,
                        timeout=10)
        return got.json() if got.status_code == 200 else None

    return poll(saved, timeout_s=20, what=f"archive item {item_id}")


def test_one_round_runs_the_tool_and_resumes_the_model(server: Server) -> None:
    r = post(server, chat("t1", 'call add {"a": 2, "b": 3}'))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "tool said: 5"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["x_modelyard_tool_rounds"] == [
        {"round": 1, "tool": "add", "arguments": '{"a":2,"b":3}', "result": "5",
         "is_error": False}]  # fmt: skip


def test_the_model_sees_the_servers_tools_not_the_mcp_entry(server: Server) -> None:
    post(server, chat("t1", 'call add {"a": 1, "b": 1}'))
    sent = model_requests(server, "t1")[-1]
    names = [t["function"]["name"] for t in sent["tools"]]
    assert names == ["add", "boom", "hang"]
    assert sent["messages"][-1] == {"role": "tool", "tool_call_id": sent["messages"][-2][
        "tool_calls"][0]["id"], "content": "2"}  # fmt: skip


def model_requests(server: Server, model: str) -> list[Any]:
    st = model_status(server, model)
    assert st is not None and st.get("upstream"), st
    return list(httpx.get(st["upstream"].rstrip("/") + "/requests", timeout=10).json())


def test_parallel_calls_run_in_one_round(server: Server) -> None:
    body = post(server, chat("t1", 'call add {"a": 1, "b": 2} call add {"a": 3, "b": 4}')).json()
    trace = body["x_modelyard_tool_rounds"]
    assert [(t["round"], t["result"]) for t in trace] == [(1, "3"), (1, "7")]
    assert body["choices"][0]["message"]["content"] == "tool said: 7"


def test_a_failing_tool_comes_back_as_an_error_result(server: Server) -> None:
    body = post(server, chat("t1", "call boom {}")).json()
    [entry] = body["x_modelyard_tool_rounds"]
    assert entry["is_error"] and "failed on purpose" in entry["result"]
    assert body["choices"][0]["message"]["content"].startswith("tool said: ")
    assert "failed on purpose" in body["choices"][0]["message"]["content"]


def test_the_round_cap_stops_a_model_that_keeps_calling(server: Server) -> None:
    body = post(server, chat("t1", '[loop] call add {"a": 1, "b": 1}')).json()
    assert len(body["x_modelyard_tool_rounds"]) == ROUNDS
    assert [t["round"] for t in body["x_modelyard_tool_rounds"]] == [1, 2, 3]
    assert body["choices"][0]["finish_reason"] == "length"
    assert "max_tool_rounds" in body["choices"][0]["message"]["content"]


def test_streaming_shows_each_round_before_the_final_tokens(server: Server) -> None:
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30,
                      json=chat("t1", 'call add {"a": 2, "b": 3}', stream=True)) as r:  # fmt: skip
        assert r.status_code == 200
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    reasoning = [d.get("reasoning_content") for d in deltas]
    assert reasoning[:2] == ['→ add({"a":2,"b":3})\n', "← 5\n"]
    rounds = [e.get("x_modelyard_tool_round") for e in events[:2]]
    assert rounds[1] == {"round": 1, "tool": "add", "arguments": '{"a":2,"b":3}',
                         "result": "5", "is_error": False}  # fmt: skip
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "tool said: 5"
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert first_content > 1
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_a_hanging_tool_times_out_and_frees_the_lease_meanwhile(server: Server) -> None:
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30,
                      json=chat("t-hang", "call hang {}", stream=True)) as r:  # fmt: skip
        events = sse_events(r.iter_lines())
        started = next(events)
        assert started["choices"][0]["delta"]["reasoning_content"] == "→ hang({})\n"
        # The tool runs: no lease held, and the model (max_concurrency 1) serves others.
        st = model_status(server, "t-hang")
        assert st is not None and st["leases"] == 0
        other = post(server, {"model": "t-hang", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2})  # fmt: skip
        assert other.status_code == 200
        done = next(events)
        assert done["x_modelyard_tool_round"]["is_error"]
        assert "timed out" in done["x_modelyard_tool_round"]["result"]
        rest = list(events)
    assert rest[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in rest[:-1])
    assert text.startswith("tool said: error: tool 'hang' timed out")


def test_a_client_leaving_mid_loop_cancels_it_and_holds_no_lease(server: Server) -> None:
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30,
                      json=chat("t-cancel", "call hang {}", stream=True)) as r:  # fmt: skip
        events = sse_events(r.iter_lines())
        assert next(events)["x_modelyard_tool_round"]["tool"] == "hang"
    # gone mid-tool: nothing leaked, and the model and the MCP server still serve
    poll(lambda: (m := model_status(server, "t-cancel")) is not None and m["leases"] == 0,
         what="no lease")  # fmt: skip
    again = post(server, chat("t-cancel", 'call add {"a": 5, "b": 5}'))
    assert again.json()["choices"][0]["message"]["content"] == "tool said: 10"


def test_a_preset_enables_its_servers(server: Server) -> None:
    body = {"model": "agent", "messages": [{"role": "user", "content": 'call add {"a":4,"b":4}'}]}
    r = post(server, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "tool said: 8"


def test_an_unknown_server_is_refused(server: Server) -> None:
    r = post(server, {**chat("t1", "hi"), "tools": [{"type": "mcp", "server": "nope"}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tools" and "nope" in r.json()["error"]["message"]


def test_a_client_tool_call_goes_back_to_the_client(server: Server) -> None:
    mine = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    r = post(server, {**chat("t1", 'call lookup {"q": "x"}'), "tools": [MCP, mine]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "lookup"
    assert r.json()["x_modelyard_tool_rounds"] == []


def test_ollama_chat_streams_rounds_as_thinking_then_the_answer(server: Server) -> None:
    body = {**chat("t1", 'call add {"a": 2, "b": 3}'), "stream": True}
    with httpx.stream("POST", server.url + "/api/chat", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = [json.loads(line) for line in r.iter_lines() if line]
    thinking = [m["message"].get("thinking") for m in lines]
    assert thinking[:2] == ['→ add({"a":2,"b":3})\n', "← 5\n"]
    assert lines[1]["x_modelyard_tool_round"]["result"] == "5"
    assert "".join(m["message"]["content"] for m in lines) == "tool said: 5"
    assert [m["done"] for m in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["done_reason"] == "stop"
    assert len(lines[-1]["x_modelyard_tool_rounds"]) == 1


def test_ollama_chat_whole_answer_carries_the_trace(server: Server) -> None:
    body = {**chat("t1", "call boom {}"), "stream": False}
    r = httpx.post(server.url + "/api/chat", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["done"] and out["message"]["content"].startswith("tool said: ")
    assert out["x_modelyard_tool_rounds"][0]["is_error"]


def test_front_shutdown_stops_the_mcp_server(tmp_path: Path) -> None:
    starts = tmp_path / "mcp.starts"
    argv = [sys.executable, str(MCP_SERVER), "--start-log", str(starts)]
    cfg = config(fake_model("t-own"), mcp_servers=[{"id": "test", "command": argv}])
    server = Server(tmp_path / "front", cfg)
    try:
        server.wait_healthy()
        assert not starts.exists()  # connected lazily, on first use
        assert post(server, chat("t-own", 'call add {"a":1,"b":2}')).status_code == 200
        post(server, chat("t-own", 'call add {"a":1,"b":2}'))
        [pid] = [int(line.split()[1]) for line in starts.read_text().splitlines()]
        assert pid_alive(pid)  # one server, kept across requests
        os.kill(server.proc.pid, signal.SIGTERM)  # the front alone, not its process group
        server.proc.wait(30)
        poll(lambda: not pid_alive(pid), timeout_s=10, what="the MCP server to exit")
    finally:
        server.stop()


def test_a_first_round_error_is_a_real_status_even_when_streaming(server: Server) -> None:
    r = post(server, chat("no-such-model", "hi", stream=True))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(server.url + "/api/chat", json=chat("no-such-model", "hi"), timeout=30)
    assert r.status_code == 404 and "error" in r.json()


@pytest.mark.parametrize("api", ["openai", "ollama"])
def test_a_tool_loop_turn_in_a_session_stores_its_rounds(server: Server, api: str) -> None:
    """A session turn that runs tools stores the whole exchange (the calls, the results, the
    answer), so the next turn, which sends only its new message, shows the model all of it."""
    sid = f"agent-{api}"
    body = chat("t1", 'call add {"a": 2, "b": 3}', session_id=sid, stream=False)
    r = httpx.post(server.url + ("/v1/chat/completions" if api == "openai" else "/api/chat"),
                   json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-session-id"] == sid
    answer = (r.json()["choices"][0]["message"] if api == "openai" else r.json()["message"])
    assert answer["content"] == "tool said: 5"
    stored = httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=10).json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[1]["tool_calls"][0]["function"]["name"] == "add"
    assert stored[2]["content"] == "5" and stored[3]["content"] == "tool said: 5"
    r = post(server, chat("t1", "thanks", session_id=sid))
    assert r.status_code == 200, r.text
    sent = model_requests(server, "t1")[-1]
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "tool", "assistant",
                                                     "user"]
    assert "session_id" not in sent
    turns = httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=10).json()["turns"]
    assert turns == 2


@pytest.mark.parametrize(("api", "stream"), [("openai", False), ("openai", True),
                                             ("ollama", True)])
def test_an_archived_tool_loop_chat_keeps_the_whole_exchange(
    server: Server, api: str, stream: bool
) -> None:
    """Asked to archive (body field), the transcript is the exchange with its tool rounds, the
    response names the item, and the `archive` field never reaches the backend."""
    marker = f'call add {{"a": 20, "b": 22}} archived {api} {stream}'
    body = chat("t1", marker, stream=stream, archive="1d")
    path = "/v1/chat/completions" if api == "openai" else "/api/chat"
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    item_id = r.headers["x-modelyard-archive-id"]
    assert "archive" not in model_requests(server, "t1")[-1]

    item = archived(server, item_id)
    assert item["kind"] == "chat" and item["retention"] == "1d" and item["meta"]["complete"]
    doc = httpx.get(f"{server.url}/archive/{item_id}/content", headers=server.admin_headers,
                    timeout=10).json()
    roles = [m["role"] for m in doc["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert doc["messages"][1]["tool_calls"][0]["function"]["name"] == "add"
    assert doc["messages"][2]["content"] == "42"
    assert doc["messages"][3] == {"role": "assistant", "content": "tool said: 42"}
    assert doc["finish_reason"] == "stop" and doc["api"] == api


@pytest.mark.parametrize("api", ["openai", "ollama"])
def test_an_archived_streamed_loop_cut_short_saves_the_exchange_so_far(
    server: Server, api: str
) -> None:
    """The streamed response names its item before the loop ends; a client that leaves
    mid-loop still finds that item: the conversation up to the tool call, marked incomplete."""
    text = f"call hang {{}} archived and left {api}"
    body = chat("t-cancel", text, stream=True, archive="1d")
    path = "/v1/chat/completions" if api == "openai" else "/api/chat"
    with httpx.stream("POST", server.url + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        item_id = r.headers["x-modelyard-archive-id"]
        lines = (line for line in r.iter_lines() if line)
        first = next(sse_events(lines)) if api == "openai" else json.loads(next(lines))
        assert first["x_modelyard_tool_round"]["tool"] == "hang"

    item = archived(server, item_id)
    assert item["meta"]["complete"] is False
    doc = httpx.get(f"{server.url}/archive/{item_id}/content", headers=server.admin_headers,
                    timeout=10).json()
    assert doc["complete"] is False
    assert [m["role"] for m in doc["messages"]][:2] == ["user", "assistant"]
    assert doc["messages"][0]["content"] == text
    assert doc["messages"][1]["tool_calls"][0]["function"]["name"] == "hang"
