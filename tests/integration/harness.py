"""Helpers shared by the integration tests: configs, request builders for the three APIs, stream
parsers and process checks. Every server here is a real `modelyard serve` process and
every model a real fake llama-server process (tests/fakes/fake_backend.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from tests.support import Server, fake_model, free_port, poll

T = TypeVar("T")

APIS = ("openai", "ollama", "native")
HELLO = [{"role": "user", "content": "Say hello to me"}]  # 4 prompt "tokens" for the fake
# The fake's deterministic output (tests/fakes/fake_backend.py: generated_text).
TEXT_16 = "The quick brown fox jumps over the lazy dog by a river The quick brown fox"
TEXT_3 = "The quick brown"


def config(*models: dict[str, Any], **settings: Any) -> dict[str, Any]:
    """A front config that sees only `models`: no HF cache scan, no GPU probing."""
    return {"scan_hf_cache": False, "devices": "cpu", **settings, "models": list(models)}


def crash_once_model(model_id: str, files: Path) -> dict[str, Any]:
    """A fake whose first process crashes after 3 tokens and whose later ones are healthy.

    The argv runs through `sh`: the first start leaves a marker file and adds
    `--crash-after-tokens 3`; `exec` keeps the pid, so /status and the start log agree.
    """
    spec = fake_model(model_id, "--start-log", str(files / f"{model_id}.starts"))
    script = 'if [ -e "$0" ]; then exec "$@"; fi; : > "$0"; exec "$@" --crash-after-tokens 3'
    spec["argv"] = ["sh", "-c", script, str(files / f"{model_id}.crashed"), *spec["argv"]]
    return spec


@contextlib.contextmanager
def module_server(
    factory: pytest.TempPathFactory, cfg: dict[str, Any], *args: str
) -> Iterator[Server]:
    """One server shared by the tests of a module (they use distinct models)."""
    server = Server(factory.mktemp("front"), cfg, *args)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def pid_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (dead, not yet reaped by its parent) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def starts(log: Path) -> list[int]:
    """Pids of the fake processes that wrote to a `--start-log` file, in order."""
    if not log.exists():
        return []
    return [int(line.split()[1]) for line in log.read_text().splitlines()]


def status(server: Server) -> dict[str, Any]:
    """The full /status (pids, upstream URLs, errors): an admin's view, as the CLI gets it."""
    r = httpx.get(server.url + "/status", headers=server.admin_headers, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def model_status(server: Server, model: str) -> dict[str, Any] | None:
    for engine in status(server)["engines"]:
        for m in engine.get("models", []):
            if m["model"] == model:
                return dict(m)
    return None


def leases_back(server: Server, model: str) -> dict[str, Any]:
    """`model`'s status once the engine holds no lease of it. A request's lease can reach the
    engine up to 20 ms after its answer ended: the front keeps it that long for its next
    request (front/engines/idle_leases.py, LINGER_S); one that never comes back fails here."""
    return poll(lambda: (m := model_status(server, model)) is not None and m["leases"] == 0 and m,
                timeout_s=5, what=f"{model}'s leases back at the engine")  # fmt: skip


def chat_request(
    api: str, model: str, *, stream: bool, max_tokens: int | None = None
) -> tuple[str, dict[str, Any]]:
    """Path and body of a chat request in the given API's own dialect."""
    body: dict[str, Any] = {"model": model, "messages": HELLO, "stream": stream}
    if api == "openai":
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        return "/v1/chat/completions", body
    if api == "ollama":
        if max_tokens is not None:
            body["options"] = {"num_predict": max_tokens}
        return "/api/chat", body
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return "/chat", body


def sse_data(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


def stream_events(api: str, text: str) -> list[Any]:
    """The events of a streamed answer: JSON objects, and the string "[DONE]" for OpenAI."""
    if api == "ollama":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return [d if d == "[DONE]" else json.loads(d) for d in sse_data(text)]


def event_text(api: str, event: Any) -> str:
    """The generated text one streamed event carries."""
    if not isinstance(event, dict):
        return ""
    if api == "openai":
        parts = [(c.get("delta") or {}).get("content") for c in event.get("choices", [])]
        return "".join(p for p in parts if p)
    if api == "ollama":
        return str((event.get("message") or {}).get("content") or "")
    return str((event.get("delta") or {}).get("content") or "")


def answer_text(api: str, body: dict[str, Any]) -> str:
    """The generated text of a non-streamed answer."""
    if api == "openai":
        return str(body["choices"][0]["message"]["content"])
    return str(body["message"]["content"])


def engine_access(server: Server, index: int = 0) -> tuple[int, str, int]:
    """Engine `index`'s loopback port, secret and pid, found as any process of the server's user
    could: the port in the front's log, the secret in the engine's environment."""
    ports = re.findall(rf"engine-{index} ready at http://127\.0\.0\.1:(\d+)", server.output())
    assert ports, server.output()
    pid = int(status(server)["engines"][index]["pid"])
    return int(ports[-1]), process_env(pid).get("MODELYARD_ENGINE_SECRET", ""), pid


def process_env(pid: int) -> dict[str, str]:
    """The environment `pid` started with (readable only by its own user)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(v.decode().split("=", 1) for v in raw if b"=" in v)


@contextlib.asynccontextmanager
async def served_in_process(app: Any) -> AsyncIterator[int]:
    """`app` served by uvicorn on a free loopback port in this event loop, its lifespan run;
    yields the port once it accepts connections, stops it after."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on",
                                           log_level="warning"))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if serving.done():
                serving.result()
                raise RuntimeError("the front stopped before it started")
            await asyncio.sleep(0.05)
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 30)
