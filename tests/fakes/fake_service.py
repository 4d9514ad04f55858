"""An honest fake of a registered service (TTS, STT or image): a real HTTP server process.

    python tests/fakes/fake_service.py --host H --port P --kind speech|transcription|image [flags]

modelyard does not start a service; it schedules one through its routes, so this fake has them:
`GET /health` (always 200: it answers whether or not its weights are loaded), `POST /load` and
`POST /unload` (mark it loaded / unloaded and count the calls), `GET /stats` (`loaded`, `loads`,
`unloads`, `requests`, and `history`: every load and unload with its wall-clock time in ns, so a
test can order the calls of two fakes), and one generation route for its kind (`--path`, default
the OpenAI one):

- speech: JSON `{"input": …}` → `speech_audio(input)`, `audio/wav` bytes (every byte value, more
  than one read's worth, so a relay that re-encodes or truncates is caught);
- transcription: multipart/form-data with a `file` part → `{"text": "heard NAME (N bytes)"}`;
- image: JSON `{"prompt": …}` → `{"created": …, "data": [{"b64_json": image_b64(prompt)}]}`.

A generation request while unloaded answers 409 `{"error": "not loaded"}`: a test that gets an
answer proves modelyard loaded the service first. `--fail-status N` makes every generation answer
N with a JSON body (`failure_body(N)`). `--claim-bytes N` files this process's claim on the
simulated GPU (`$MODELYARD_SIMULATED_GPU_DIR/<pid>` = bytes, as hw/simulated.py reads it) while
loaded and removes it when unloaded, so the simulated device sees the memory come and go.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import email.parser
import email.policy
import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

CLAIMS_DIR_ENV = "MODELYARD_SIMULATED_GPU_DIR"
DEFAULT_PATHS = {
    "speech": "/v1/audio/speech",
    "transcription": "/v1/audio/transcriptions",
    "image": "/v1/images/generations",
}
FIXED_CREATED = 1_700_000_000


def speech_audio(text: str) -> bytes:
    """The fake's "audio" for `text`: a RIFF header, a digest of the text, then 256 KiB."""
    return b"RIFF" + hashlib.sha256(text.encode()).digest() + bytes(range(256)) * 1024


def image_b64(prompt: str) -> str:
    return base64.b64encode(b"\x89PNG\r\n\x1a\n" + prompt.encode()).decode()


def failure_body(status: int) -> dict[str, Any]:
    return {"error": {"message": f"fake service failure ({status})", "code": status}}


def log(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class Claim:
    """This process's claim on the simulated GPU, filed atomically."""

    def __init__(self, nbytes: int | None) -> None:
        where = os.environ.get(CLAIMS_DIR_ENV)
        self.nbytes = nbytes
        self.path = Path(where) / str(os.getpid()) if where and nbytes else None

    def file(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"tmp-{os.getpid()}")  # never all digits: not read as a claim
        tmp.write_text(str(self.nbytes))
        tmp.replace(self.path)

    def drop(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


class Fake:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.loaded = False
        self.loads = 0
        self.unloads = 0
        self.requests = 0
        self.history: list[dict[str, Any]] = []
        self.claim = Claim(opts.claim_bytes)

    def set_loaded(self, loaded: bool) -> None:
        if loaded:
            self.claim.file()
        else:
            self.claim.drop()
        self.loaded = loaded

    def stats(self) -> dict[str, Any]:
        keys = ("loaded", "loads", "unloads", "requests", "history")
        return {k: getattr(self, k) for k in keys}


def read_form(body: bytes, content_type: str) -> dict[str, tuple[str | None, bytes]]:
    """The parts of a multipart/form-data body: name → (filename, bytes)."""
    head = f"Content-Type: {content_type}\r\n\r\n".encode("latin-1")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if not message.is_multipart():
        return {}
    parts: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if isinstance(name, str) and isinstance(payload, bytes):
            parts[name] = (part.get_filename(), payload)
    return parts


def bad_request(message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=400)


def build_app(fake: Fake) -> Starlette:
    opts = fake.opts

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "loaded": fake.loaded})

    async def load(request: Request) -> Response:
        fake.loads += 1
        fake.set_loaded(True)
        fake.history.append({"event": "load", "at_ns": time.time_ns()})
        log(f"fake service: loaded (load {fake.loads})")
        return JSONResponse({"loaded": True})

    async def unload(request: Request) -> Response:
        fake.unloads += 1
        fake.set_loaded(False)
        fake.history.append({"event": "unload", "at_ns": time.time_ns()})
        log(f"fake service: unloaded (unload {fake.unloads})")
        return JSONResponse({"loaded": False})

    async def stats(request: Request) -> Response:
        return JSONResponse(fake.stats())

    async def generate(request: Request) -> Response:
        fake.requests += 1
        body = await request.body()
        if not fake.loaded:
            return JSONResponse({"error": "not loaded"}, status_code=409)
        if opts.fail_status:
            return JSONResponse(failure_body(opts.fail_status), status_code=opts.fail_status)
        if opts.kind == "transcription":
            form = read_form(body, request.headers.get("content-type", ""))
            if "file" not in form:
                return bad_request("multipart field 'file' is required")
            filename, data = form["file"]
            model = form.get("model", (None, b""))[1].decode()
            return JSONResponse({"text": f"heard {filename} ({len(data)} bytes)", "model": model})
        try:
            data = json.loads(body)
        except ValueError:
            return bad_request("the body must be JSON")
        if opts.kind == "speech":
            if not isinstance(data.get("input"), str):
                return bad_request("'input' is required")
            return Response(speech_audio(data["input"]), media_type="audio/wav")
        if not isinstance(data.get("prompt"), str):
            return bad_request("'prompt' is required")
        image = {"b64_json": image_b64(data["prompt"])}
        return JSONResponse({"created": FIXED_CREATED, "data": [image]})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        fake.claim.drop()

    routes = [
        Route("/health", health),
        Route("/load", load, methods=["POST"]),
        Route("/unload", unload, methods=["POST"]),
        Route("/stats", stats),
        Route(opts.path or DEFAULT_PATHS[opts.kind], generate, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (it is logged)")
    p.add_argument("--kind", choices=sorted(DEFAULT_PATHS), required=True)
    p.add_argument("--path", default=None, help="generation route; default: the OpenAI one")
    loaded = p.add_mutually_exclusive_group()
    loaded.add_argument("--start-loaded", dest="start_loaded", action="store_true")
    loaded.add_argument("--start-unloaded", dest="start_loaded", action="store_false")
    p.add_argument("--claim-bytes", type=int, default=None)
    p.add_argument("--fail-status", type=int, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    fake = Fake(opts)
    if opts.start_loaded:
        fake.set_loaded(True)
    family = socket.AF_INET6 if ":" in opts.host else socket.AF_INET
    sock = socket.create_server((opts.host, opts.port), family=family)
    port = sock.getsockname()[1]
    log(f"fake service: {opts.kind} listening on http://{opts.host}:{port}")
    config = uvicorn.Config(build_app(fake), log_level="warning", access_log=False, workers=1)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
