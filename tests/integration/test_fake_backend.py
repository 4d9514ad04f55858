"""The fake llama-server (tests/fakes/fake_backend.py) behaves as documented: real processes,
real sockets, one behaviour per test."""

from __future__ import annotations

import importlib.util
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from tests.support import poll

pytestmark = pytest.mark.integration

FAKE = Path(__file__).resolve().parents[1] / "fakes" / "fake_backend.py"
ALIAS = "demo-model"
LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
TIMINGS_KEYS = {
    "cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
    "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second",
}  # fmt: skip
T = TypeVar("T")


def _load_fake() -> Any:
    spec = importlib.util.spec_from_file_location("fake_backend", FAKE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


fake = _load_fake()


@dataclass
class Backend:
    proc: subprocess.Popen[bytes]
    port: int
    stderr_path: Path
    spawned_at: float

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def get(self, path: str) -> httpx.Response | None:
        """GET, or None while nothing listens yet."""
        try:
            return httpx.get(self.url + path, timeout=10)
        except httpx.TransportError:
            return None

    def post(self, path: str, body: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=20)

    def wait_listening(self) -> httpx.Response:
        return poll(lambda: self.get("/health"), what="the port to listen")

    def wait_ready(self) -> None:
        poll(lambda: (r := self.get("/health")) is not None and r.status_code == 200, what="200")

    def stats(self) -> dict[str, int]:
        return httpx.get(self.url + "/stats", timeout=10).json()  # type: ignore[no-any-return]

    def sse(self, path: str, body: Any) -> list[Any]:
        """The decoded `data:` events of a stream ('[DONE]' kept as a string)."""
        with httpx.stream("POST", self.url + path, json=body, timeout=20) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            return [_event(line) for line in r.iter_lines() if line]


def _event(line: str) -> Any:
    assert line.startswith("data: "), line
    data = line.removeprefix("data: ")
    return data if data == "[DONE]" else json.loads(data)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Backend]]:
    started: list[Backend] = []

    def start(*flags: str) -> Backend:
        port = _free_port()
        stderr_path = tmp_path / f"fake-{len(started)}.log"
        argv = [sys.executable, str(FAKE), "-m", "/models/demo.gguf", "-c", "2048", "--jinja",
                "-ngl", "99", "--host", "127.0.0.1", "--port", str(port), "--alias", ALIAS,
                *flags]  # fmt: skip
        with stderr_path.open("wb") as err:
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
        started.append(Backend(proc, port, stderr_path, time.monotonic()))
        return started[-1]

    yield start
    for b in started:
        if b.proc.poll() is None:
            b.proc.kill()
        b.proc.wait(timeout=10)


def chat(max_tokens: int | None = 3, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": ALIAS, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello there you"}]},
    ], **extra}  # fmt: skip
    return body if max_tokens is None else {**body, "max_tokens": max_tokens}


@pytest.mark.timeout(30)
def test_port_listens_while_loading_and_health_turns_ok(spawn: Callable[..., Backend]) -> None:
    b = spawn("--load-time-s", "1.5")
    first = b.wait_listening()
    assert first.status_code == 503 and first.json() == LOADING
    assert first.headers["content-type"].startswith("application/json")
    models = b.get("/v1/models")
    assert models is not None and models.status_code == 503 and models.json() == LOADING
    assert b.post("/v1/chat/completions", chat()).status_code == 503
    assert b.stats()["requests_started"] == 0  # /stats answers during loading
    b.wait_ready()
    assert time.monotonic() - b.spawned_at >= 1.5
    ok = b.get("/health")
    assert ok is not None and ok.json() == {"status": "ok"}
    log = b.stderr()
    assert "fake: loading model '/models/demo.gguf'" in log
    assert log.index("fake: loading model") < log.index("fake: model loaded")
    assert f"main: server is listening on http://127.0.0.1:{b.port}" in log


@pytest.mark.timeout(30)
def test_start_log_gets_one_line_per_spawn(spawn: Callable[..., Backend], tmp_path: Path) -> None:
    start_log = tmp_path / "starts.log"
    backends = [spawn("--start-log", str(start_log)) for _ in range(2)]
    for b in backends:
        b.wait_ready()
    lines = sorted(start_log.read_text().splitlines())
    assert lines == sorted(f"start {b.proc.pid}" for b in backends)


@pytest.mark.timeout(30)
def test_crash_on_load_exits_1_after_the_load_time(spawn: Callable[..., Backend]) -> None:
    b = spawn("--load-time-s", "0.5", "--crash-on-load")
    listening = b.wait_listening()
    assert listening.status_code == 503
    assert b.proc.wait(timeout=20) == 1
    assert time.monotonic() - b.spawned_at >= 0.5
    assert "fake: error: failed to load model" in b.stderr()
    assert "fake: model loaded" not in b.stderr()


@pytest.mark.timeout(30)
def test_silent_stall_loads_forever_without_output(spawn: Callable[..., Backend]) -> None:
    b = spawn("--silent-stall")
    assert b.wait_listening().status_code == 503
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # 503 throughout: it never finishes loading
        r = b.get("/health")
        assert r is not None and r.json() == LOADING
        time.sleep(0.1)
    assert b.proc.poll() is None
    assert b.stderr() == ""
    b.proc.send_signal(signal.SIGTERM)  # like llama-server, no handler before the model is loaded
    assert b.proc.wait(timeout=10) == -signal.SIGTERM


@pytest.mark.timeout(30)
def test_progress_while_loading_prints_lines(spawn: Callable[..., Backend]) -> None:
    b = spawn("--load-time-s", "1.2", "--progress-while-loading")
    b.wait_ready()
    progress = [line for line in b.stderr().splitlines() if "loading progress" in line]
    assert len(progress) >= 3
    assert progress[-1].endswith("1.00")


@pytest.mark.timeout(30)
def test_chat_completion_has_llama_server_shape(spawn: Callable[..., Backend]) -> None:
    b = spawn()
    b.wait_ready()
    r = b.post("/v1/chat/completions", chat(max_tokens=5))
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == ALIAS and isinstance(body["created"], int)
    assert body["choices"] == [{
        "finish_reason": "length", "index": 0,
        "message": {"role": "assistant", "content": fake.generated_text(5)},
    }]  # fmt: skip
    assert fake.generated_text(5) == "The quick brown fox jumps"
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (5, 5, 10)
    assert set(body["timings"]) == TIMINGS_KEYS
    assert body["timings"]["prompt_n"] == 5 and body["timings"]["predicted_n"] == 5


@pytest.mark.timeout(30)
def test_limits_and_finish_reasons(spawn: Callable[..., Backend]) -> None:
    b = spawn()
    b.wait_ready()
    unlimited = b.post("/v1/chat/completions", chat(max_tokens=None)).json()
    assert unlimited["choices"][0]["finish_reason"] == "stop"
    assert unlimited["usage"]["completion_tokens"] == fake.DEFAULT_N_PREDICT
    n_predict = b.post("/v1/chat/completions", chat(max_tokens=9, n_predict=2)).json()
    assert n_predict["choices"][0]["message"]["content"] == "The quick"
    assert n_predict["choices"][0]["finish_reason"] == "length"


@pytest.mark.timeout(30)
def test_chat_stream_with_usage(spawn: Callable[..., Backend]) -> None:
    b = spawn()
    b.wait_ready()
    opts = {"stream": True, "stream_options": {"include_usage": True}}
    events = b.sse("/v1/chat/completions", chat(max_tokens=3, **opts))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert {c["model"] for c in chunks} == {ALIAS}
    assert chunks[0]["choices"] == [
        {"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}
    ]
    tokens = [c["choices"][0]["delta"]["content"] for c in chunks[1:4]]
    assert tokens == ["The", " quick", " brown"]
    assert chunks[4]["choices"] == [{"finish_reason": "length", "index": 0, "delta": {}}]
    usage_chunk = chunks[5]
    assert usage_chunk["choices"] == [] and len(chunks) == 6
    assert usage_chunk["usage"]["completion_tokens"] == 3
    assert usage_chunk["usage"]["total_tokens"] == 3 + 5
    assert set(usage_chunk["timings"]) == TIMINGS_KEYS  # on the last chunk, as llama-server does


@pytest.mark.timeout(30)
def test_chat_stream_without_usage(spawn: Callable[..., Backend]) -> None:
    b = spawn()
    b.wait_ready()
    events = b.sse("/v1/chat/completions", chat(max_tokens=2, stream=True))
    assert events[-1] == "[DONE]" and len(events) == 1 + 2 + 1 + 1
    final = events[-2]
    assert final["choices"][0]["finish_reason"] == "length" and "usage" not in final
    assert final["timings"]["predicted_n"] == 2
    assert all("usage" not in e and "timings" not in e for e in events[:-2])


@pytest.mark.timeout(30)
def test_text_completions(spawn: Callable[..., Backend]) -> None:
    b = spawn()
    b.wait_ready()
    body = b.post("/v1/completions", {"prompt": "one two three four", "max_tokens": 4}).json()
    assert body["object"] == "text_completion" and body["model"] == ALIAS
    assert body["choices"] == [{
        "text": "The quick brown fox", "index": 0, "logprobs": None, "finish_reason": "length",
    }]  # fmt: skip
    assert body["usage"]["prompt_tokens"] == 4 and set(body["timings"]) == TIMINGS_KEYS
    events = b.sse("/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True})
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["The", " quick", ""]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 2 and "timings" in events[-2]


@pytest.mark.timeout(30)
def test_bad_requests_get_llama_style_400(spawn: Callable[..., Backend]) -> None:
    b = spawn()
    b.wait_ready()
    url = b.url + "/v1/chat/completions"
    bad_json = httpx.post(url, content=b"{not json", timeout=10)
    no_messages = httpx.post(url, json={"model": ALIAS}, timeout=10)
    not_object = httpx.post(url, json=[1, 2], timeout=10)
    bad_limit = httpx.post(url, json=chat(max_tokens="many"), timeout=10)  # type: ignore[arg-type]
    for r in (bad_json, no_messages, not_object, bad_limit):
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["code"] == 400 and error["type"] == "invalid_request_error"
        assert error["message"]
    assert b.stats()["requests_started"] == 0


@pytest.mark.timeout(30)
def test_models_and_slots(spawn: Callable[..., Backend]) -> None:
    b = spawn()
    b.wait_ready()
    models = httpx.get(b.url + "/v1/models", timeout=10).json()
    assert models["object"] == "list" and len(models["data"]) == 1
    assert {k: models["data"][0][k] for k in ("id", "object", "owned_by")} == {
        "id": ALIAS, "object": "model", "owned_by": "fake",
    }  # fmt: skip
    assert httpx.get(b.url + "/slots", timeout=10).json() == [{"id": 0, "is_processing": False}]


@pytest.mark.timeout(30)
def test_tokens_per_s_paces_generation(spawn: Callable[..., Backend]) -> None:
    b = spawn("--tokens-per-s", "20")
    b.wait_ready()
    t0 = time.monotonic()
    body = b.post("/v1/chat/completions", chat(max_tokens=10)).json()
    assert time.monotonic() - t0 >= 0.45  # 10 tokens at 20/s
    assert body["timings"]["predicted_ms"] >= 450
    assert body["timings"]["predicted_per_second"] <= 21


@pytest.mark.timeout(30)
def test_crash_after_tokens_drops_the_stream(spawn: Callable[..., Backend]) -> None:
    b = spawn("--crash-after-tokens", "3")
    b.wait_ready()
    lines: list[str] = []
    with (
        pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)),
        httpx.stream("POST", b.url + "/v1/chat/completions", json=chat(10, stream=True)) as r,
    ):
        lines.extend(line for line in r.iter_lines() if line)
    contents = [_event(line)["choices"][0]["delta"].get("content") for line in lines]
    assert contents == [None, "The", " quick", " brown"]  # role chunk + 3 tokens, then EOF
    assert b.proc.wait(timeout=10) == 3
    assert "fake: simulated crash after 3 tokens" in b.stderr()


@pytest.mark.timeout(30)
def test_crash_after_tokens_never_answers_non_stream(spawn: Callable[..., Backend]) -> None:
    b = spawn("--crash-after-tokens", "50")  # more than the request asks: it dies at the end
    b.wait_ready()
    with pytest.raises(httpx.RemoteProtocolError):
        b.post("/v1/chat/completions", chat(max_tokens=4))
    assert b.proc.wait(timeout=10) == 3


@pytest.mark.timeout(30)
def test_client_disconnect_cancels_generation(spawn: Callable[..., Backend]) -> None:
    b = spawn("--tokens-per-s", "20")
    b.wait_ready()
    body = chat(max_tokens=10_000, stream=True)
    with httpx.stream("POST", b.url + "/v1/chat/completions", json=body, timeout=20) as r:
        events = r.iter_lines()
        assert _event(next(events))["choices"][0]["delta"]["role"] == "assistant"
        assert _event(next(line for line in events if line))["choices"][0]["delta"]["content"]
        assert b.stats() == {
            "requests_started": 1, "requests_completed": 0, "requests_cancelled": 0, "active": 1,
        }  # fmt: skip
        assert httpx.get(b.url + "/slots").json() == [{"id": 0, "is_processing": True}]
    poll(lambda: b.stats()["requests_cancelled"] == 1, what="the cancel to be counted")
    assert b.stats() == {
        "requests_started": 1, "requests_completed": 0, "requests_cancelled": 1, "active": 0,
    }  # fmt: skip
    assert httpx.get(b.url + "/slots").json() == [{"id": 0, "is_processing": False}]
    b.post("/v1/chat/completions", chat(max_tokens=2))
    assert b.stats()["requests_completed"] == 1 and b.stats()["active"] == 0


@pytest.mark.timeout(30)
def test_sigterm_exits_cleanly_once_loaded(spawn: Callable[..., Backend]) -> None:
    b = spawn()
    b.wait_ready()
    b.proc.send_signal(signal.SIGTERM)
    assert b.proc.wait(timeout=10) == 0
    assert "cleaning up before exit" in b.stderr()


@pytest.mark.timeout(30)
def test_ignore_sigterm_needs_sigkill(spawn: Callable[..., Backend]) -> None:
    b = spawn("--ignore-sigterm", "--load-time-s", "0.5")
    b.wait_listening()
    b.proc.send_signal(signal.SIGTERM)  # while loading
    b.wait_ready()
    b.proc.send_signal(signal.SIGTERM)  # and once loaded, after uvicorn has started
    with pytest.raises(subprocess.TimeoutExpired):
        b.proc.wait(timeout=1.5)
    r = b.get("/health")
    assert r is not None and r.status_code == 200
    b.proc.kill()
    assert b.proc.wait(timeout=10) == -signal.SIGKILL


TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("add", "boom")]  # fmt: skip


def tool_chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": ALIAS, "messages": list(messages), "tools": TOOLS, **extra}


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


@pytest.mark.timeout(10)
def test_plan_tools_directives_and_rounds() -> None:
    two = _user('call add {"a": 2, "b": 3} then call boom {}')
    assert fake.plan_tools(tool_chat(two)) == [("add", '{"a":2,"b":3}'), ("boom", "{}")]
    assert fake.plan_tools(tool_chat(two, parallel_tool_calls=False)) == [("add", '{"a":2,"b":3}')]
    assert fake.plan_tools(tool_chat(two, tool_choice="none")) is None
    assert fake.plan_tools({"model": ALIAS, "messages": [two]}) is None  # no tools: plain text
    assert fake.plan_tools(tool_chat(_user("hi"))) is None
    assert fake.plan_tools(tool_chat(_user("hi"), tool_choice="required")) == [("add", "{}")]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}}
    asked = {"role": "assistant", "content": None, "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "5"}
    assert fake.plan_tools(tool_chat(_user("call add {}"), asked, result)) == "tool said: 5"
    looping = tool_chat(_user("[loop] call add {}"), asked, result)
    assert fake.plan_tools(looping) == [("add", '{"a":1}')]


@pytest.mark.timeout(30)
def test_tool_calls_in_llama_server_wire_format(spawn: Callable[..., Backend]) -> None:
    b = spawn()
    b.wait_ready()
    ask = tool_chat(_user('call add {"a": 2, "b": 3} call boom {}'))
    body = b.post("/v1/chat/completions", ask).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [c["function"] for c in calls] == [
        {"name": "add", "arguments": '{"a":2,"b":3}'}, {"name": "boom", "arguments": "{}"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    events = b.sse("/v1/chat/completions", {**ask, "stream": True})
    assert events[-1] == "[DONE]" and "timings" in events[-2]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    parts = [d["tool_calls"][0] for e in events[:-1] for c in e["choices"]
             if "tool_calls" in (d := c["delta"])]  # fmt: skip
    heads = [p for p in parts if "id" in p]
    assert [(h["index"], h["function"]) for h in heads] == [
        (0, {"name": "add", "arguments": ""}), (1, {"name": "boom", "arguments": ""})]
    args0 = [p["function"]["arguments"] for p in parts if p["index"] == 0 and "id" not in p]
    assert len(args0) > 1 and "".join(args0) == '{"a":2,"b":3}'  # fragments over chunks
    result = {"role": "tool", "tool_call_id": heads[0]["id"], "content": "5"}
    answer = b.post("/v1/chat/completions", tool_chat(_user("x"), result)).json()
    assert answer["choices"][0]["message"]["content"] == "tool said: 5"
    assert answer["choices"][0]["finish_reason"] == "stop"
