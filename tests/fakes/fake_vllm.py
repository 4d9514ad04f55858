"""An honest fake of `vllm serve --enable-sleep-mode`: a real HTTP server process.

    python tests/fakes/fake_vllm.py --host H --port P --served-model-name NAME [flags]

It speaks the routes modelyard drives (vLLM's `vllm/entrypoints/serve/sleep/api_router.py`):
`POST /sleep?level=N`, `POST /wake_up`, `GET /is_sleeping` (`{"is_sleeping": bool}`) — served
only when VLLM_SERVER_DEV_MODE=1 is in its environment (else 404, as vLLM does) — plus
`GET /health`, `GET /v1/models` and a non-streamed `POST /v1/chat/completions` answering
`generated_text(n)` of the fake llama-server. While asleep a chat answers 503
`{"error": "asleep"}`: a test that gets an answer proves modelyard woke it first.

`--claim-bytes N` holds N bytes of the simulated GPU ($MODELYARD_SIMULATED_GPU_DIR/<pid>) while
awake and `--asleep-bytes R` (the CUDA context a sleeping vLLM keeps) while asleep.
`--start-log FILE` appends `start <pid>` (a restart shows as a second line). `--sleep-delay-s S`
makes a sleep show on /is_sleeping only S seconds after its POST returned (vLLM's own FIXME:
with frontend multiprocessing the POST may return before the sleep is done).
`GET /fake/calls` lists the sleep and wake-up calls received, in order.
With VLLM_API_KEY in its environment, a /v1 route without `Authorization: Bearer <that key>`
answers 401 `{"error": "Unauthorized"}` (vLLM's AuthenticationMiddleware checks /v1 routes only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

# Run as a script: its own folder is on sys.path, so the fake llama-server's helpers import.
from fake_backend import claim_memory, generated_text
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send


class FakeVllm:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.asleep = False
        self.asleep_at: float | None = None  # when /is_sleeping starts saying so
        self.calls: list[str] = []
        self.dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
        claim_memory(opts.claim_bytes)

    def is_sleeping(self) -> bool:
        return self.asleep and (self.asleep_at is None or time.monotonic() >= self.asleep_at)

    async def sleep(self, request: Request) -> Response:
        if not self.dev_mode:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        level = int(request.query_params.get("level", "1"))
        self.calls.append(f"sleep {level}")
        self.asleep = True
        self.asleep_at = time.monotonic() + self.opts.sleep_delay_s
        claim_memory(self.opts.asleep_bytes)
        return Response(status_code=200)

    async def wake_up(self, request: Request) -> Response:
        if not self.dev_mode:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        self.calls.append("wake_up")
        claim_memory(self.opts.claim_bytes)
        self.asleep = False
        return Response(status_code=200)

    async def is_sleeping_route(self, request: Request) -> Response:
        if not self.dev_mode:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return JSONResponse({"is_sleeping": self.is_sleeping()})

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        name = self.opts.served_model_name
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model"}]})

    async def chat(self, request: Request) -> Response:
        if self.asleep:
            return JSONResponse({"error": "asleep"}, status_code=503)
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        return JSONResponse({
            "id": "chatcmpl-fake", "object": "chat.completion", "created": 1,
            "model": self.opts.served_model_name,
            "choices": [{"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": generated_text(n)}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1},
        })

    async def fake_calls(self, request: Request) -> Response:
        return JSONResponse(self.calls)

    def app(self) -> Any:
        inner = self.routes()
        key = os.environ.get("VLLM_API_KEY")

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if (key and scope["type"] == "http" and scope["path"].startswith("/v1")
                    and dict(scope["headers"]).get(b"authorization") != f"Bearer {key}".encode()):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(
                    scope, receive, send)
                return
            await inner(scope, receive, send)

        return app

    def routes(self) -> Starlette:
        return Starlette(routes=[
            Route("/sleep", self.sleep, methods=["POST"]),
            Route("/wake_up", self.wake_up, methods=["POST"]),
            Route("/is_sleeping", self.is_sleeping_route, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/fake/calls", self.fake_calls, methods=["GET"]),
        ])


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # SIGTERM keeps its default action: the process exits at once


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default="fake")
    p.add_argument("--claim-bytes", type=int, default=0)
    p.add_argument("--asleep-bytes", type=int, default=0)
    p.add_argument("--sleep-delay-s", type=float, default=0.0)
    p.add_argument("--start-log")
    opts, _ = p.parse_known_args(argv)  # vLLM's other options (--model, --enable-sleep-mode…)
    return opts


def main() -> None:
    opts = parse_args(sys.argv[1:])
    if opts.start_log:
        with open(opts.start_log, "a") as f:
            f.write(f"start {os.getpid()}\n")
    fake = FakeVllm(opts)
    sock = socket.create_server((opts.host, opts.port))
    config = uvicorn.Config(fake.app(), log_level="warning", access_log=False, workers=1)
    asyncio.run(_Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    main()
