"""How the front holds up at scale: many idle keep-alive clients, many streams, a big catalog.

    make bench-load                           # about 1-2 minutes on 2 cores
    .venv/bin/python bench/load.py --quick    # the smallest configuration (~20 s)

A real front (`modelyard serve`, a subprocess, as a user runs it) with one engine on the CPU, the
repository's fake llama-server (tests/fakes/fake_backend.py) as its streaming model, and a
directory of stub GGUF files (4-byte magic, nothing else: discovery lists them without reading
metadata) as its catalog.

1. **Catalog**: for each catalog size (`--models`, e.g. 100/1000/10000 stubs), a fresh front,
   no client load: front RSS, `/health` p50/p99 and `/v1/models` p50/p99.
2. **Connections**: on the front with the largest catalog, `--streams` streaming clients (long
   streams from the fake at `--tokens-per-s`, restarted when they end), then idle keep-alive
   clients added up to each of `--connections` (each sent one `GET /health` on its connection,
   read the answer and keeps the connection open, idle): the same measures at each step.

The clients run in a separate process (this file with `--worker`), so the probes that time
`/health` and `/v1/models` (sequential, one keep-alive connection, from here) share no event
loop with 1,000 sockets and 64 streams. Before and after each measure the worker checks that
every idle connection is still open and every stream delivered a chunk since the last check:
a measure taken while the load had fallen away would flatter the front.

Printed: one row per measure, the slope of each measure per 1000 connections and per 1000
models (least squares over the points), and the targets at the largest point (front RSS
< 250 MB and `/health` p99 < 20 ms with 1,000 idle connections and 64 streams). Results go to
bench/results/load-<timestamp>.json. Loopback only; every loop is bounded and the worker exits
by itself after `--max-s`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.proxy import Proc, stop_all
from modelyard.engine.backends.openai_server import free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
FAKE_BACKEND = ROOT / "tests" / "fakes" / "fake_backend.py"
HOST = "127.0.0.1"
STREAM_MODEL = "stream"
TARGET_RSS_MB = 250.0
TARGET_HEALTH_P99_MS = 20.0
MB = 1e6


def _ints(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--connections", type=_ints, default=[0, 250, 1000],
                   help="idle keep-alive connections at each step (comma-separated)")
    p.add_argument("--models", type=_ints, default=[100, 1000, 10000],
                   help="stub models in the catalog at each step (comma-separated)")
    p.add_argument("--streams", type=int, default=64, help="streaming clients during step 2")
    p.add_argument("--tokens-per-s", type=float, default=8.0, help="each stream's token rate")
    p.add_argument("--health-probes", type=int, default=300, help="/health requests per measure")
    p.add_argument("--models-probes", type=int, default=20,
                   help="/v1/models requests per measure")
    p.add_argument("--max-s", type=float, default=600.0,
                   help="the client worker stops by itself after this long")
    p.add_argument("--quick", action="store_true",
                   help="the smallest configuration: 0,50 connections, 10,100 models, 4 streams")
    p.add_argument("--out", type=Path, help="JSON results (default bench/results/load-<ts>.json)")
    p.add_argument("--keep-workdir", action="store_true", help="keep the temp dir with the logs")
    p.add_argument("--worker", metavar="URL", help=argparse.SUPPRESS)  # the client process
    p.add_argument("--worker-tokens", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.connections, args.models, args.streams = [0, 50], [10, 100], 4
        args.health_probes, args.models_probes = 100, 10
    return args


# --------------------------------------------------------------------------------------------
# The client worker: idle connections and streams, driven by JSON lines on stdin.


@dataclass
class _Idle:
    writer: asyncio.StreamWriter
    watch: asyncio.Task[None]
    closed: bool = False


class Worker:
    def __init__(self, url: str, tokens: int) -> None:
        self.host, port = url.removeprefix("http://").split(":")
        self.port = int(port)
        self.tokens = tokens
        self.idle: list[_Idle] = []
        self.idle_errors: list[str] = []
        self.streams: list[asyncio.Task[None]] = []
        self.chunks: list[int] = []  # per stream, since the last check
        self.stream_errors: list[str] = []
        self.stopping = asyncio.Event()

    async def open_idle(self, n: int) -> dict[str, Any]:
        """Idle keep-alive connections up to `n`, each after one answered GET /health."""
        sem = asyncio.Semaphore(32)  # a burst of connects past the listen backlog is not idle

        async def one() -> None:
            async with sem:
                try:
                    self.idle.append(await self._connect_idle())
                except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
                    self.idle_errors.append(repr(exc))

        await asyncio.gather(*(one() for _ in range(max(0, n - len(self.idle)))))
        return self.report()

    async def _connect_idle(self) -> _Idle:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        writer.write(f"GET /health HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise ValueError(head[:80].decode(errors="replace"))
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await reader.readexactly(length)
        conn = _Idle(writer, asyncio.create_task(asyncio.sleep(0)))
        conn.watch = asyncio.create_task(self._watch(reader, conn))
        return conn

    @staticmethod
    async def _watch(reader: asyncio.StreamReader, conn: _Idle) -> None:
        # An idle connection hears nothing; EOF (or anything at all) means the front let go.
        with contextlib.suppress(OSError):
            await reader.read(1)
        conn.closed = True

    async def start_streams(self, n: int, timeout_s: float = 60.0) -> dict[str, Any]:
        import aiohttp

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_read=30),
        )
        first = [asyncio.Event() for _ in range(n)]
        self.chunks = [0] * n
        self.streams = [asyncio.create_task(self._stream(i, first[i])) for i in range(n)]
        waits = [asyncio.create_task(e.wait()) for e in first]
        _, pending = await asyncio.wait(waits, timeout=timeout_s)
        for w in pending:
            w.cancel()
        return self.report()

    async def _stream(self, i: int, first: asyncio.Event) -> None:
        import aiohttp

        body = {"model": STREAM_MODEL, "stream": True, "max_tokens": self.tokens,
                "messages": [{"role": "user", "content": f"stream {i}"}]}
        url = f"http://{self.host}:{self.port}/v1/chat/completions"
        while not self.stopping.is_set():
            try:
                async with self.session.post(url, json=body) as r:
                    if r.status != 200:
                        self.stream_errors.append(f"stream {i}: {r.status} {await r.text()}")
                        return
                    async for data in r.content.iter_any():
                        self.chunks[i] += data.count(b"\n\n")
                        first.set()
                        if self.stopping.is_set():
                            return
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.stream_errors.append(f"stream {i}: {exc!r}")
                return

    async def check(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """What holds now, once every stream delivered a chunk since the last check (or after
        `timeout_s`); resets the per-stream chunk counts."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (loop.time() < deadline and not self.stopping.is_set()
               and any(c == 0 for c in self.chunks)):
            await asyncio.sleep(0.05)
        return self.report()

    def report(self) -> dict[str, Any]:
        report = {
            "idle_open": sum(not c.closed for c in self.idle),
            "idle_closed": sum(c.closed for c in self.idle),
            "idle_errors": self.idle_errors[-3:],
            "n_idle_errors": len(self.idle_errors),
            "streams": len(self.streams),
            "streams_flowing": sum(1 for c in self.chunks if c > 0),
            "streams_done": sum(t.done() for t in self.streams),
            "stream_errors": self.stream_errors[-3:],
            "n_stream_errors": len(self.stream_errors),
            "chunks": sum(self.chunks),
        }
        self.chunks = [0] * len(self.chunks)
        return report

    async def stop(self) -> dict[str, Any]:
        self.stopping.set()
        report = self.report()
        for t in self.streams:
            t.cancel()
        await asyncio.gather(*self.streams, return_exceptions=True)
        if self.streams:
            await self.session.close()
        for c in self.idle:
            c.watch.cancel()
            c.writer.close()
        return report


async def _worker_main(url: str, tokens: int, max_s: float) -> None:
    worker = Worker(url, tokens)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    deadline = loop.time() + max_s
    while True:
        try:
            line = await asyncio.wait_for(reader.readline(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            line = b""  # out of time: stop as if told to
        cmd: dict[str, Any] = json.loads(line) if line.strip() else {"op": "stop"}
        if cmd["op"] == "idle":
            reply = await worker.open_idle(cmd["n"])
        elif cmd["op"] == "streams":
            reply = await worker.start_streams(cmd["n"])
        elif cmd["op"] == "check":
            reply = await worker.check()
        else:
            reply = await worker.stop()
        print(json.dumps(reply), flush=True)
        if cmd["op"] == "stop":
            return


class WorkerProc:
    """The client process: one JSON command a line, one JSON reply a line."""

    def __init__(self, url: str, args: argparse.Namespace, log: Path) -> None:
        # A stream lasts until stopped: far more tokens than the run can produce.
        tokens = int(args.tokens_per_s * args.max_s) + 16
        self.log = log.open("ab")
        self.popen = subprocess.Popen(
            [sys.executable, __file__, "--worker", url, "--max-s", str(args.max_s),
             "--worker-tokens", str(tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            start_new_session=True, text=True,
        )

    def ask(self, op: str, **fields: Any) -> dict[str, Any]:
        stdin, stdout = self._pipes()
        stdin.write(json.dumps({"op": op, **fields}) + "\n")
        stdin.flush()
        line = stdout.readline()
        if not line:
            rc = self.popen.wait()
            raise RuntimeError(f"the client worker died (rc {rc}): see {self.log.name}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _pipes(self) -> tuple[IO[str], IO[str]]:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        return self.popen.stdin, self.popen.stdout

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(RuntimeError, OSError, ValueError):
                self.ask("stop")
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self.log.close()


# --------------------------------------------------------------------------------------------
# The front under test


def raise_fd_limit(needed: int) -> int:
    """Raise this process's soft open-files limit (the front and the worker inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        soft = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


def make_stubs(directory: Path, n: int) -> None:
    """`n` files discovery takes for GGUF models (the magic is all it reads)."""
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (directory / f"stub-model-{i:05d}.Q4_0.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")


def start_front(workdir: Path, n_models: int, args: argparse.Namespace) -> tuple[Proc, str]:
    home = workdir / f"home-{n_models}"
    stubs = workdir / f"stubs-{n_models}"
    make_stubs(stubs, n_models)
    home.mkdir(parents=True, exist_ok=True)
    stream_model = {
        "id": STREAM_MODEL, "backend": "openai",
        "argv": [sys.executable, str(FAKE_BACKEND), "--host", "$host", "--port", "$port",
                 "--alias", "$id", "--tokens-per-s", str(args.tokens_per_s)],
        "max_concurrency": args.streams + 8,  # every stream runs: none waits in the queue
    }
    config = {
        "scan_hf_cache": False, "devices": "cpu", "model_dirs": [str(stubs)],
        # Idle clients keep their connections for the whole run (uvicorn's 5 s default would
        # close them between two steps).
        "client_keep_alive_s": args.max_s,
        "models": [stream_model],
    }
    (home / "config.yaml").write_text(yaml.safe_dump(config))
    port = free_port()
    env = {**os.environ, "MODELYARD_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    env.pop("MODELYARD_CONFIG", None)
    argv = [sys.executable, "-m", "modelyard", "serve", "--port", str(port),
            "--config", str(home / "config.yaml")]
    proc = Proc(f"front-{n_models}", argv, workdir / f"front-{n_models}.log", env)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.exited() is not None:
            raise RuntimeError(f"the front exited ({proc.exited()}):\n{proc.tail()}")
        with contextlib.suppress(OSError, ValueError, http.client.HTTPException):
            status, body = get(url, "/health", timeout_s=2)
            if status == 200 and json.loads(body).get("status") == "healthy":
                return proc, url
        time.sleep(0.1)
    raise TimeoutError(f"the front was not healthy after 120 s:\n{proc.tail()}")


def get(url: str, path: str, timeout_s: float = 30) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=timeout_s)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def load_stream_model(url: str) -> None:
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=120)
    try:
        body = json.dumps({"model": STREAM_MODEL, "max_tokens": 1,
                           "messages": [{"role": "user", "content": "hi"}]})
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        text = r.read()
        if r.status != 200:
            raise RuntimeError(f"loading {STREAM_MODEL}: {r.status} {text[:200]!r}")
    finally:
        conn.close()


# --------------------------------------------------------------------------------------------
# Measures


def pct(samples: Sequence[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def timed_gets(url: str, path: str, n: int) -> tuple[list[float], int]:
    """`n` sequential GETs on one keep-alive connection: latencies (ms) and the last body size."""
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    out, size = [], 0
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            conn.request("GET", path)
            r = conn.getresponse()
            body = r.read()
            out.append((time.perf_counter() - t0) * 1e3)
            if r.status != 200:
                raise RuntimeError(f"GET {path}: {r.status} {body[:200]!r}")
            size = len(body)
    finally:
        conn.close()
    return out, size


def measure(front: Proc, url: str, args: argparse.Namespace, **point: Any) -> dict[str, Any]:
    timed_gets(url, "/health", 5)  # warm: the probe's own connection, first-call paths
    timed_gets(url, "/v1/models", 1)
    health, _ = timed_gets(url, "/health", args.health_probes)
    models, size = timed_gets(url, "/v1/models", args.models_probes)
    proc = psutil.Process(front.popen.pid)
    _, body = get(url, "/health")
    return {
        **point,
        "catalog": json.loads(body)["models_available"],
        "rss_mb": proc.memory_info().rss / MB,
        "fds": proc.num_fds(),
        "health_p50_ms": statistics.median(health),
        "health_p99_ms": pct(health, 99),
        "health_max_ms": max(health),
        "models_p50_ms": statistics.median(models),
        "models_p99_ms": pct(models, 99),
        "models_body_kb": size / 1e3,
    }


def slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x, per 1000 of x."""
    if len(points) < 2:
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    return 1000 * sum((x - mx) * (y - my) for x, y in points) / sxx


def check_load(report: dict[str, Any], conns: int, streams: int) -> None:
    """The load is what the row says, or the measure is void."""
    problems = []
    if report["idle_open"] != conns:
        problems.append(f"{report['idle_open']} of {conns} idle connections open "
                        f"({report['n_idle_errors']} failed: {report['idle_errors']})")
    if report["streams_flowing"] != streams:
        problems.append(f"{report['streams_flowing']} of {streams} streams flowing "
                        f"({report['n_stream_errors']} failed: {report['stream_errors']})")
    if problems:
        raise RuntimeError("; ".join(problems))


def run(args: argparse.Namespace, workdir: Path, results: dict[str, Any]) -> None:
    rows: list[dict[str, Any]] = results["rows"]
    for n_models in args.models:
        front, url = start_front(workdir, n_models, args)
        print(f"catalog: {n_models} stub models", flush=True)
        rows.append(measure(front, url, args, phase="catalog", models=n_models, conns=0,
                            streams=0))
        if n_models != args.models[-1]:
            front.stop()
    # The largest catalog's front stays up for the connection steps.
    load_stream_model(url)
    worker = WorkerProc(url, args, workdir / "worker.log")
    try:
        if args.streams:
            check_load(worker.ask("streams", n=args.streams), 0, args.streams)
        for conns in args.connections:
            print(f"connections: {conns} idle + {args.streams} streams", flush=True)
            worker.ask("idle", n=conns)
            check_load(worker.ask("check"), conns, args.streams)  # flowing since they opened
            row = measure(front, url, args, phase="connections", models=args.models[-1],
                          conns=conns, streams=args.streams)
            check_load(worker.ask("check"), conns, args.streams)  # and throughout the measure
            rows.append(row)
    finally:
        worker.stop()
        front.stop()


# --------------------------------------------------------------------------------------------
# Report


def summarize(results: dict[str, Any]) -> None:
    rows = results["rows"]
    by_models = [r for r in rows if r["phase"] == "catalog"]
    by_conns = [r for r in rows if r["phase"] == "connections"]
    slopes: dict[str, float | None] = {}
    for key in ("rss_mb", "health_p50_ms", "health_p99_ms", "models_p50_ms"):
        slopes[f"{key} per 1000 models"] = slope([(r["models"], r[key]) for r in by_models])
        slopes[f"{key} per 1000 connections"] = slope([(r["conns"], r[key]) for r in by_conns])
    results["slopes"] = slopes
    top = by_conns[-1] if by_conns else rows[-1]
    results["targets"] = [
        {"target": f"front RSS < {TARGET_RSS_MB:g} MB", "value": top["rss_mb"],
         "pass": top["rss_mb"] < TARGET_RSS_MB},
        {"target": f"/health p99 < {TARGET_HEALTH_P99_MS:g} ms", "value": top["health_p99_ms"],
         "pass": top["health_p99_ms"] < TARGET_HEALTH_P99_MS},
    ]
    results["target_point"] = {k: top[k] for k in ("models", "conns", "streams")}


def render(results: dict[str, Any]) -> str:
    lines = [
        "Front at scale (one CPU engine, fake streaming backend, stub GGUF catalog)",
        "",
        "| phase | models | idle conns | streams | front RSS MB | fds | /health p50 ms "
        "| /health p99 ms | /health p99 vs idle | /v1/models p50 ms | /v1/models p99 ms "
        "| /v1/models KB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # The baseline, measured in the same run: the same catalog with no client load.
    idle = {r["models"]: r["health_p99_ms"] for r in results["rows"] if r["phase"] == "catalog"}
    for r in results["rows"]:
        lines.append(
            f"| {r['phase']} | {r['catalog']} | {r['conns']} | {r['streams']} "
            f"| {r['rss_mb']:.1f} | {r['fds']} | {r['health_p50_ms']:.2f} "
            f"| {r['health_p99_ms']:.2f} | {r['health_p99_ms'] / idle[r['models']]:.2f} "
            f"| {r['models_p50_ms']:.2f} | {r['models_p99_ms']:.2f} "
            f"| {r['models_body_kb']:.0f} |")
    lines += ["", "| slope | per 1000 models | per 1000 connections |", "|---|---|---|"]
    for key, label in (("rss_mb", "front RSS MB"), ("health_p50_ms", "/health p50 ms"),
                       ("health_p99_ms", "/health p99 ms"), ("models_p50_ms", "/v1/models p50 ms")):
        cells = [results["slopes"][f"{key} per 1000 {what}"] for what in ("models", "connections")]
        lines.append(f"| {label} | " + " | ".join(
            "n/a" if c is None else f"{c:+.2f}" for c in cells) + " |")
    p = results["target_point"]
    lines += ["", f"Targets at {p['conns']} idle connections + {p['streams']} streams, "
              f"{p['models']} models:"]
    for t in results["targets"]:
        lines.append(f"- {t['target']}: {t['value']:.2f}  {'PASS' if t['pass'] else 'MISS'}")
    return "\n".join(lines)


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        asyncio.run(_worker_main(args.worker, args.worker_tokens, args.max_s))
        return 0
    signal.signal(signal.SIGTERM, _interrupt)
    fd_limit = raise_fd_limit(max(args.connections) + args.streams + 1024)
    workdir = Path(tempfile.mkdtemp(prefix="bench-load-"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k != "out"} | {"fd_limit": fd_limit},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "rows": [],
    }
    started = time.monotonic()
    try:
        run(args, workdir, results)
    finally:
        stop_all()
    results["duration_s"] = time.monotonic() - started
    summarize(results)
    out = args.out or RESULTS_DIR / f"load-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    if not args.keep_workdir:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    print("\n" + render(results) + f"\n\n{results['duration_s']:.0f} s; results in {out}")
    return 0  # a benchmark: misses are reported, not failures


if __name__ == "__main__":
    sys.exit(main())
