"""What modelyard's relay costs: the same requests straight to llama-server, through modelyard,
through llama-server's own router mode (`--models-dir`) and through the cheapest Python relay
(`floor`: bench/floor_relay.py, uvicorn + aiohttp and nothing else, in front of the direct
llama-server), interleaved so load drift hits all of them. For every relay it also prints the CPU
its own processes spent per request (modelyard: front and engine), read from /proc.

    make bench-proxy                      # defaults: about 3-4 minutes on 2 cores
    .venv/bin/python bench/proxy.py --help

Every llama-server runs the same binary with the same arguments (modelyard's own command line for
the demo model; the router passes the same options to the child it spawns). Only one target is
driven at a time. Results are printed as markdown tables and written to
bench/results/proxy-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import yaml

from modelyard.config import DEMO_MODEL_FILE, DEMO_MODEL_ID, LlamaCppModel, Settings, cache_dir
from modelyard.engine.backends.llamacpp import llama_server_argv
from modelyard.engine.backends.openai_server import free_port, render_argv

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
HOST = "127.0.0.1"
MODEL = DEMO_MODEL_ID
MESSAGES = [{"role": "user", "content": "Name one colour of the rainbow."}]
# Options that name one model instance; the router sets these itself for the child it spawns.
INSTANCE_OPTIONS = {"--model", "--host", "--port", "--alias"}
PAIRED = {"chat_1tok_c1", "stream"}  # workloads whose samples line up round by round
# The targets of issue 17 ([wave 2 · 3/7]), each against direct llama-server in the same run.
GOALS = {"added_p50_c1_ms": 1.0, "ratio_c8": 0.97, "ratio_wide": 0.95,
         "stream_added_total_ms": 5.0, "cold_overhead_ms": 25.0, "stream_vs_router_ms": 5.0}


# --------------------------------------------------------------------------------------------
# Options


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--requests", type=int, default=200, help="1-token requests per target, c=1")
    p.add_argument("--concurrent-requests", type=int, default=120,
                   help="1-token requests per target at --concurrency")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--wide-concurrency", type=int, default=64,
                   help="a second concurrent workload, many clients at once (0: skip)")
    p.add_argument("--wide-requests", type=int, default=192,
                   help="1-token requests per target at --wide-concurrency")
    p.add_argument("--batch", type=int, default=40,
                   help="requests per target per interleaved batch at --concurrency")
    p.add_argument("--streams", type=int, default=12, help="128-token streams per target")
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--cold-repeats", type=int, default=5, help="cold loads per target (0: skip)")
    p.add_argument("--warmup", type=int, default=10, help="unmeasured requests per target")
    p.add_argument("--ctx-size", type=int, default=2048)
    # llama-server answers HTTP on `--parallel` + 2 threads by default: clients that keep more
    # connections alive than that wait for a keep-alive to expire (direct at concurrency 8: p99
    # 4.4 s, 21 req/s against 50), so the baseline measured that stall, not the relays.
    p.add_argument("--llama-args", default="--threads-http 80",
                   help="extra llama-server options for every target, e.g. '-np 4 -no-kvu'")
    p.add_argument("--no-router", action="store_true", help="leave out the router column")
    p.add_argument("--no-floor", action="store_true",
                   help="leave out the floor column (the cheapest Python relay)")
    p.add_argument("--single-process", action="store_true",
                   help="run modelyard with --single-process (front and engine in one process)")
    p.add_argument("--llama-server", type=Path, help="binary (default: modelyard's resolution)")
    p.add_argument("--model", type=Path, help=f"GGUF (default: the cached {DEMO_MODEL_FILE})")
    p.add_argument("--wait-binary", type=float, default=900.0,
                   help="seconds to wait for the llama-server binary (it may be building)")
    p.add_argument("--keep-workdir", action="store_true", help="keep the temp dir with the logs")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------
# Processes: each in its own session; stopping one also stops everything it spawned.


_LIVE: set[Proc] = set()


class Proc:
    def __init__(
        self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self._log_handle = log.open("ab")
        self.popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=self._log_handle, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )
        _LIVE.add(self)

    def exited(self) -> int | None:
        return self.popen.poll()

    def tail(self, lines: int = 15) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.popen.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, grace_s: float = 15.0) -> None:
        """TERM the group (a clean shutdown stops grandchildren), then KILL whatever is left."""
        if self not in _LIVE:
            return
        _LIVE.discard(self)
        family = self.descendants()
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        _signal_group(self.popen.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(family, timeout=grace_s)
        for child in alive:
            with contextlib.suppress(psutil.Error):
                child.kill()
        self._log_handle.close()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def stop_all() -> None:
    for proc in list(_LIVE):
        proc.stop()


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


# --------------------------------------------------------------------------------------------
# Inputs


def find_binary(args: argparse.Namespace) -> Path:
    if args.llama_server is not None:
        return Path(args.llama_server)
    deadline = time.monotonic() + args.wait_binary
    announced = False
    while True:
        found = Settings().resolve_llama_server()
        if found is not None and os.access(found, os.X_OK):
            return found
        if time.monotonic() >= deadline:
            sys.exit("no llama-server binary: run `make llama-server` or pass --llama-server")
        if not announced:
            print(f"waiting up to {args.wait_binary:.0f} s for llama-server to be built…",
                  flush=True)
            announced = True
        time.sleep(5)


def find_model(args: argparse.Namespace) -> Path:
    candidates = [args.model] if args.model else [
        cache_dir() / "models" / DEMO_MODEL_FILE, Settings().models_dir / DEMO_MODEL_FILE,
    ]
    for path in candidates:
        if path.is_file():
            return Path(path).resolve()
    sys.exit(f"no model at {', '.join(map(str, candidates))}: run `make demo-model`")


@dataclass(frozen=True)
class Inputs:
    binary: Path
    model: Path
    ctx_size: int
    workdir: Path
    extra_args: tuple[str, ...] = ()  # appended to every llama-server's command line

    def instance_argv(self, port: int) -> list[str]:
        """modelyard's own llama-server command line for the demo model (what the engine runs)."""
        settings = Settings(
            home=self.workdir / "unused", llama_server_path=self.binary,
            default_ctx_size=self.ctx_size, scan_hf_cache=False,
        )
        # The argv names a --slot-save-path; llama-server refuses to start if it is missing.
        settings.session_kv_dir.mkdir(parents=True, exist_ok=True)
        spec = LlamaCppModel(id=MODEL, path=self.model, extra_args=list(self.extra_args))
        template, values = llama_server_argv(spec, settings)
        # The direct and router targets run keyless: the bench's clients call them straight.
        # (modelyard's engine starts its own with a per-load key, which the front sends: that
        # check is part of what the modelyard target measures.)
        if "--api-key-file" in template:
            i = template.index("--api-key-file")
            del template[i:i + 2]
        return render_argv(template, {**values, "host": HOST, "port": str(port)})

    def shared_args(self) -> list[str]:
        """The instance argv minus the binary and the options that name one instance."""
        argv, out, i = self.instance_argv(0)[1:], [], 0
        while i < len(argv):
            if argv[i] in INSTANCE_OPTIONS:
                i += 2
                continue
            out.append(argv[i])
            i += 1
        return out


# --------------------------------------------------------------------------------------------
# Targets


@dataclass
class Target:
    name: str
    url: str
    proc: Proc
    notes: list[str] = field(default_factory=list)
    # The relay's own processes by role, whose CPU time is charged to its requests.
    cpu: dict[str, psutil.Process] = field(default_factory=dict)

    def cpu_s(self) -> dict[str, float]:
        out = {}
        for role, p in self.cpu.items():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                out[role] = t.user + t.system
        return out


def relay_processes(target: Target) -> dict[str, psutil.Process]:
    """The processes that relay for `target` (not the llama-server doing the work)."""
    if target.name == "direct":
        return {}
    root = psutil.Process(target.proc.popen.pid)
    if target.name != "modelyard":
        return {target.name: root}  # the router process itself; the floor relay
    found = {"front": root}
    for child in target.proc.descendants():
        with contextlib.suppress(psutil.Error):
            if "--engine-only" in child.cmdline():
                found["engine"] = child
    return found


def spawn_direct(inputs: Inputs, tag: str = "direct") -> tuple[Proc, str]:
    port = free_port()
    proc = Proc(tag, inputs.instance_argv(port), inputs.workdir / f"{tag}.log")
    return proc, f"http://{HOST}:{port}"


def spawn_router(inputs: Inputs, tag: str = "router") -> tuple[Proc, str]:
    models_dir = inputs.workdir / "router-models"
    models_dir.mkdir(exist_ok=True)
    link = models_dir / f"{MODEL}.gguf"  # the router names a model after its file stem
    if not link.exists():
        link.symlink_to(inputs.model)
    port = free_port()
    argv = [str(inputs.binary), "--models-dir", str(models_dir), "--host", HOST,
            "--port", str(port), *inputs.shared_args()]
    return Proc(tag, argv, inputs.workdir / f"{tag}.log"), f"http://{HOST}:{port}"


def modelyard_home(inputs: Inputs, single_process: bool) -> Path:
    home = inputs.workdir / "modelyard-home"
    (home / "models").mkdir(parents=True, exist_ok=True)
    link = home / "models" / DEMO_MODEL_FILE  # served as the demo model, `smollm2`
    if not link.exists():
        link.symlink_to(inputs.model)
    config: dict[str, Any] = {
        "scan_hf_cache": False,
        "default_ctx_size": inputs.ctx_size,
        "llama_server_path": str(inputs.binary),
        "devices": "cpu",
        "single_process": single_process,
    }
    if inputs.extra_args:  # only a declared model takes extra_args
        config["models"] = [{"id": MODEL, "backend": "llamacpp", "path": str(link),
                             "extra_args": list(inputs.extra_args)}]
    (home / "config.yaml").write_text(yaml.safe_dump(config))
    return home


def spawn_modelyard(inputs: Inputs, home: Path, tag: str = "modelyard") -> tuple[Proc, str]:
    return spawn_serve(inputs.workdir, home, tag)


def spawn_serve(workdir: Path, home: Path, tag: str, *options: str) -> tuple[Proc, str]:
    """`modelyard serve` of `home`'s config.yaml on a free loopback port, logging to workdir."""
    port = free_port()
    env = {**os.environ, "MODELYARD_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    env.pop("MODELYARD_CONFIG", None)
    argv = [sys.executable, "-m", "modelyard", "serve", "--port", str(port),
            "--config", str(home / "config.yaml"), *options]
    return Proc(tag, argv, workdir / f"{tag}.log", env), f"http://{HOST}:{port}"


async def wait_until(
    client: httpx.AsyncClient,
    url: str,
    proc: Proc,
    ok: Callable[[httpx.Response], bool],
    *,
    interval_s: float = 0.05,
    timeout_s: float = 120.0,
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.exited() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.exited()}):\n{proc.tail()}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if ok(await client.get(url, timeout=2.0)):
                return
        await asyncio.sleep(interval_s)
    raise TimeoutError(f"{proc.name}: {url} not ready after {timeout_s:g} s:\n{proc.tail()}")


def is_200(r: httpx.Response) -> bool:
    return r.status_code == 200


def is_healthy(r: httpx.Response) -> bool:
    return r.status_code == 200 and r.json().get("status") == "healthy"


def wait_healthy_sync(client: httpx.Client, proc: Proc, url: str, timeout_s: float) -> None:
    """Block until `proc` serving `url` says healthy (for the benchmarks that run sync)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.exited() is not None:
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            if is_healthy(client.get(url + "/health", timeout=2)):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{proc.name} not healthy:\n{proc.tail()}")


async def start_targets(
    client: httpx.AsyncClient, inputs: Inputs, args: argparse.Namespace, notes: list[str]
) -> list[Target]:
    targets: list[Target] = []
    proc, url = spawn_direct(inputs)
    targets.append(Target("direct", url, proc))
    await wait_until(client, url + "/health", proc, is_200)

    proc, url = spawn_modelyard(inputs, modelyard_home(inputs, args.single_process))
    targets.append(Target("modelyard", url, proc))
    await wait_until(client, url + "/health", proc, is_healthy)

    if not args.no_floor:
        port = free_port()
        proc = Proc("floor", [sys.executable, str(ROOT / "bench" / "floor_relay.py"), str(port),
                              targets[0].url], inputs.workdir / "floor.log")
        targets.append(Target("floor", f"http://{HOST}:{port}", proc))
        await wait_until(client, targets[-1].url + "/health", proc, is_200)

    if not args.no_router:
        proc, url = spawn_router(inputs)
        router = Target("router", url, proc)
        try:
            await wait_until(client, url + "/health", proc, is_200, timeout_s=30)
            await one_shot(client, url, chat_payload(max_tokens=1))  # loads the model
            targets.append(router)
        except (RuntimeError, TimeoutError) as exc:
            notes.append(f"router mode unavailable, left out: {exc}")
            print(notes[-1], flush=True)
            proc.stop()
    return targets


def llama_server_cmdlines(target: Target) -> list[str]:
    """What the target's llama-server processes really run, for the record."""
    procs = [target.proc.popen.pid, *(p.pid for p in target.proc.descendants())]
    lines = []
    for pid in procs:
        with contextlib.suppress(psutil.Error):
            cmd = psutil.Process(pid).cmdline()
            if cmd and Path(cmd[0]).name == "llama-server":
                lines.append(" ".join(cmd))
    return lines


# --------------------------------------------------------------------------------------------
# Requests


class RequestFailed(RuntimeError):
    """A request that got no complete 200 answer (counted, not fatal, in the workloads)."""


def chat_payload(*, max_tokens: int, stream: bool = False) -> bytes:
    body: dict[str, Any] = {
        "model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": max_tokens,
    }
    if stream:
        body |= {"stream": True, "ignore_eos": True}
    return orjson.dumps(body)


HEADERS = {"content-type": "application/json"}


async def one_shot(client: httpx.AsyncClient, url: str, payload: bytes) -> float:
    """One non-streaming request; its latency in seconds."""
    start = time.perf_counter()
    try:
        r = await client.post(url + "/v1/chat/completions", content=payload, headers=HEADERS)
    except httpx.HTTPError as exc:
        raise RequestFailed(f"{url}: {type(exc).__name__}: {exc}") from exc
    elapsed = time.perf_counter() - start
    if r.status_code != 200:
        raise RequestFailed(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
    return elapsed


@dataclass
class StreamTiming:
    ttft_s: float
    total_s: float
    chunks: int
    server_s: float = math.nan  # llama-server's own time for it (its final chunk's `timings`)


def server_time_s(line: str) -> float | None:
    """llama-server's own time for a stream (prompt processing + generation), from the
    `timings` its final chunk carries; None for a line without them."""
    if '"timings"' not in line or not line.startswith("data:"):
        return None
    timings = orjson.loads(line[5:]).get("timings")
    if not isinstance(timings, dict):
        return None
    return (float(timings.get("prompt_ms", 0.0)) + float(timings.get("predicted_ms", 0.0))) / 1e3


def has_content(line: str) -> bool:
    if not line.startswith("data:") or line.endswith("[DONE]"):
        return False
    choices = orjson.loads(line[5:]).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


async def stream_once(
    client: httpx.AsyncClient, url: str, payload: bytes, *, since: float | None = None,
    first_only: bool = False,
) -> StreamTiming:
    """One SSE request; times to the first content chunk and to the end, from `since`."""
    start = time.perf_counter() if since is None else since
    ttft, chunks, server = math.nan, 0, math.nan
    try:
        async with client.stream("POST", url + "/v1/chat/completions", content=payload,
                                 headers=HEADERS) as r:
            if r.status_code != 200:
                raise RequestFailed(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if math.isnan(ttft):
                    if has_content(line):
                        ttft, chunks = time.perf_counter() - start, 1
                        if first_only:
                            break
                elif line.startswith("data:") and not line.endswith("[DONE]"):
                    chunks += 1
                    server = server_time_s(line) or server
    except httpx.HTTPError as exc:
        raise RequestFailed(f"{url}: {type(exc).__name__}: {exc}") from exc
    if math.isnan(ttft):
        raise RequestFailed(f"{url}: the stream ended without content")
    return StreamTiming(ttft, time.perf_counter() - start, chunks, server)


# --------------------------------------------------------------------------------------------
# Workloads, interleaved: round i drives the targets in an order rotated by i.


def rotated(targets: Sequence[Target], i: int) -> list[Target]:
    k = i % len(targets)
    return [*targets[k:], *targets[:k]]


@dataclass
class Samples:
    """One target's measurements in one workload; a failed request is a NaN latency."""

    latencies_s: list[float] = field(default_factory=list)
    busy_s: float = 0.0  # wall time spent driving this target
    ttft_s: list[float] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    # A stream's total less llama-server's own time for it: what HTTP and the relay added,
    # without the generation's run-to-run spread (±60 ms at 128 tokens on 2 cores).
    net_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)  # the relay's CPU, by process role

    def failed(self, exc: RequestFailed, *, stream: bool = False) -> None:
        self.errors.append(str(exc))
        self.latencies_s.append(math.nan)
        if stream:
            self.ttft_s.append(math.nan)
            self.net_s.append(math.nan)


async def request(client: httpx.AsyncClient, target: Target, payload: bytes, s: Samples) -> None:
    try:
        s.latencies_s.append(await one_shot(client, target.url, payload))
    except RequestFailed as exc:
        s.failed(exc)


async def stream_request(
    client: httpx.AsyncClient, target: Target, payload: bytes, s: Samples
) -> None:
    try:
        timing = await stream_once(client, target.url, payload)
    except RequestFailed as exc:
        s.failed(exc, stream=True)
        return
    s.latencies_s.append(timing.total_s)
    s.ttft_s.append(timing.ttft_s)
    s.chunks.append(timing.chunks)
    s.net_s.append(timing.total_s - timing.server_s)


async def timed(s: Samples, target: Target, work: Awaitable[None]) -> None:
    cpu = target.cpu_s()
    start = time.perf_counter()
    await work
    s.busy_s += time.perf_counter() - start
    for role, used in target.cpu_s().items():
        s.cpu_s[role] = s.cpu_s.get(role, 0.0) + used - cpu.get(role, used)


async def burst(
    client: httpx.AsyncClient, target: Target, payload: bytes, n: int, concurrency: int,
    s: Samples,
) -> None:
    """`n` requests from `concurrency` workers."""
    await pool(n, concurrency, lambda: request(client, target, payload, s))


async def pool(n: int, concurrency: int, job: Callable[[], Awaitable[None]]) -> None:
    """`job` run `n` times by `concurrency` workers."""
    remaining = n

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await job()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def warm_up(
    client: httpx.AsyncClient, targets: Sequence[Target], n: int, concurrency: int
) -> None:
    """Connections opened and every parallel slot's prompt cache filled, for every target."""
    payload = chat_payload(max_tokens=1)
    for target in targets:
        s = Samples()
        for _ in range(n):
            await request(client, target, payload, s)
        await burst(client, target, payload, 2 * concurrency, concurrency, s)
        await stream_request(client, target, chat_payload(max_tokens=8, stream=True), s)
        if len(s.errors) == len(s.latencies_s):
            raise RuntimeError(f"{target.name} answers nothing: {s.errors[0]}")


async def serial_1tok(
    client: httpx.AsyncClient, targets: Sequence[Target], n: int
) -> dict[str, Samples]:
    payload, out = chat_payload(max_tokens=1), {t.name: Samples() for t in targets}
    for i in range(n):
        for target in rotated(targets, i):
            s = out[target.name]
            await timed(s, target, request(client, target, payload, s))
    return out


async def concurrent_1tok(
    client: httpx.AsyncClient, targets: Sequence[Target], n: int, concurrency: int, batch: int
) -> dict[str, Samples]:
    payload = chat_payload(max_tokens=1)
    return await interleaved(targets, n, batch, lambda target, s, size: burst(
        client, target, payload, size, concurrency, s))


Drive = Callable[[Target, Samples, int], Awaitable[None]]


async def interleaved(
    targets: Sequence[Target], n: int, batch: int, drive: Drive
) -> dict[str, Samples]:
    """`n` requests per target in rounds of `batch`: `drive(target, samples, size)` sends one
    round, timed with the target's CPU; round i drives the targets in an order rotated by i."""
    out = {t.name: Samples() for t in targets}
    sizes = [min(batch, n - done) for done in range(0, n, batch)]
    for i, size in enumerate(sizes):
        for target in rotated(targets, i):
            s = out[target.name]
            await timed(s, target, drive(target, s, size))
    return out


async def streams(
    client: httpx.AsyncClient, targets: Sequence[Target], n: int, tokens: int
) -> dict[str, Samples]:
    payload = chat_payload(max_tokens=tokens, stream=True)
    out = {t.name: Samples() for t in targets}
    for i in range(n):
        for target in rotated(targets, i):
            s = out[target.name]
            await timed(s, target, stream_request(client, target, payload, s))
    return out

# --------------------------------------------------------------------------------------------
# Cold load: request → first token for a model that is not loaded yet.


@dataclass(frozen=True)
class ColdRun:
    ttft_s: float  # request (bare: spawn) → first content chunk
    ready_s: float = math.nan  # spawn → llama-server ready, as this path saw it


async def cold_bare(client: httpx.AsyncClient, inputs: Inputs) -> ColdRun:
    """The floor: spawn llama-server, poll /health every 5 ms, then the same request."""
    start = time.perf_counter()
    proc, url = spawn_direct(inputs, "cold-bare")
    try:
        await wait_health_raw(url, proc)
        ready = time.perf_counter() - start
        timing = await stream_once(client, url, cold_payload(), since=start, first_only=True)
        return ColdRun(timing.ttft_s, ready)
    finally:
        proc.stop()


async def wait_health_raw(url: str, proc: Proc, interval_s: float = 0.005) -> None:
    """Poll GET /health with a hand-written request: an httpx poll every 5 ms would take enough
    CPU from the loading server (2 cores) to slow the very thing it measures."""
    host, port = url.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        if proc.exited() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.exited()}):\n{proc.tail()}")
        with contextlib.suppress(OSError):
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                writer.write(request)
                if (await reader.readline()).split(b" ")[1:2] == [b"200"]:
                    return
            finally:
                writer.close()
        await asyncio.sleep(interval_s)
    raise TimeoutError(f"{proc.name}: not ready after 120 s:\n{proc.tail()}")


async def cold_modelyard(client: httpx.AsyncClient, inputs: Inputs, home: Path) -> ColdRun:
    proc, url = spawn_modelyard(inputs, home, "cold-modelyard")
    try:
        await wait_until(client, url + "/health", proc, is_healthy)
        timing = await stream_once(client, url, cold_payload(), first_only=True)
        return ColdRun(timing.ttft_s, await modelyard_load_s(client, url))
    finally:
        proc.stop()


async def modelyard_load_s(client: httpx.AsyncClient, url: str) -> float:
    """The engine's own spawn → ready time for the model (GET /status)."""
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
        status = (await client.get(url + "/status")).json()
        for engine in status["engines"]:
            for model in engine.get("models", []):
                if model["model"] == MODEL and model.get("load_duration_s") is not None:
                    return float(model["load_duration_s"])
    return math.nan


async def cold_router(client: httpx.AsyncClient, inputs: Inputs) -> ColdRun:
    proc, url = spawn_router(inputs, "cold-router")
    try:
        await wait_until(client, url + "/v1/models", proc, is_200)
        timing = await stream_once(client, url, cold_payload(), first_only=True)
        return ColdRun(timing.ttft_s)
    finally:
        proc.stop()


def cold_payload() -> bytes:
    return chat_payload(max_tokens=8, stream=True)


async def cold_loads(
    client: httpx.AsyncClient, inputs: Inputs, args: argparse.Namespace, with_router: bool
) -> dict[str, list[ColdRun]]:
    home = modelyard_home(inputs, args.single_process)
    runs: dict[str, Callable[[], Awaitable[ColdRun]]] = {
        "bare": lambda: cold_bare(client, inputs),
        "modelyard": lambda: cold_modelyard(client, inputs, home),
    }
    if with_router:
        runs["router"] = lambda: cold_router(client, inputs)
    out: dict[str, list[ColdRun]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(args.cold_repeats):
        for name in names[i % len(names):] + names[: i % len(names)]:
            out[name].append(await runs[name]())
    return out


# --------------------------------------------------------------------------------------------
# Statistics and report


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of the values that are not NaN (failed requests)."""
    xs = sorted(x for x in values if not math.isnan(x))
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ms(seconds: float) -> float:
    return seconds * 1000.0


def rounded_ms(values: Sequence[float]) -> list[float | None]:
    return [None if math.isnan(x) else round(ms(x), 3) for x in values]


def paired_delta_ms(xs: Sequence[float], base: Sequence[float]) -> float:
    """Median of per-round differences: robust to load drift that a difference of medians is not."""
    return ms(percentile([x - b for x, b in zip(xs, base, strict=True)], 0.5))


def summarize(s: Samples, base: Samples | None = None) -> dict[str, Any]:
    """Stats of one target; with `base` (direct, same rounds) also the paired added p50."""
    out: dict[str, Any] = {
        "n": len(s.latencies_s),
        "errors": len(s.errors),
        "first_errors": s.errors[:3],
        "rps": (len(s.latencies_s) - len(s.errors)) / s.busy_s if s.busy_s else math.nan,
        "p50_ms": ms(percentile(s.latencies_s, 0.5)),
        "p99_ms": ms(percentile(s.latencies_s, 0.99)),
        "latencies_ms": rounded_ms(s.latencies_s),
    }
    if s.ttft_s:
        out |= {
            "ttft_p50_ms": ms(percentile(s.ttft_s, 0.5)),
            "ttft_p99_ms": ms(percentile(s.ttft_s, 0.99)),
            "ttft_ms": rounded_ms(s.ttft_s),
            "chunks_min": min(s.chunks, default=0),
        }
    if s.net_s and not any(math.isnan(x) for x in s.net_s):  # every stream told its timings
        out["net_p50_ms"] = ms(percentile(s.net_s, 0.5))
    ok = len(s.latencies_s) - len(s.errors)
    if s.cpu_s and ok:
        out["cpu_ms_per_request"] = {role: ms(used / ok) for role, used in s.cpu_s.items()}
    if base is not None:
        out["paired_added_p50_ms"] = paired_delta_ms(s.latencies_s, base.latencies_s)
        if s.ttft_s:
            out["paired_added_ttft_p50_ms"] = paired_delta_ms(s.ttft_s, base.ttft_s)
        if "net_p50_ms" in out and not any(math.isnan(x) for x in base.net_s):
            out["paired_added_net_p50_ms"] = paired_delta_ms(s.net_s, base.net_s)
    return out


def fmt(x: float, spec: str = ".1f", sign: bool = False) -> str:
    if math.isnan(x):
        return "n/a"
    return format(x, ("+" if sign else "") + spec)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = [str(c).ljust(w) if i == 0 else str(c).rjust(w)
                  for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(["-" * (widths[0] + 2), *("-" * (w + 1) + ":" for w in widths[1:])])
    rule += "|"
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def request_table(summary: dict[str, dict[str, Any]]) -> str:
    base = summary["direct"]
    paired = "paired_added_p50_ms" in base
    rows = []
    for name, s in summary.items():
        row = [
            name, fmt(s["rps"]), fmt(s["rps"] / base["rps"], ".3f"),
            fmt(s["p50_ms"], ".2f"), fmt(s["p99_ms"], ".2f"),
            fmt(s["p50_ms"] - base["p50_ms"], ".2f", sign=True),
            fmt(s["p99_ms"] - base["p99_ms"], ".2f", sign=True),
        ]
        if paired:
            row.append(fmt(s["paired_added_p50_ms"], ".2f", sign=True))
        rows.append([*row, cpu_cell(s), str(s["errors"])])
    headers = ["target", "req/s", "vs direct", "p50 ms", "p99 ms", "added p50", "added p99"]
    return md_table([*headers, *(["paired added p50"] if paired else []),
                     "relay CPU ms/req", "errors"], rows)


def cpu_cell(s: dict[str, Any]) -> str:
    """The relay's CPU per request, by process: `front 1.10 + engine 0.20`."""
    cpu = s.get("cpu_ms_per_request") or {}
    return " + ".join(f"{role} {used:.2f}" for role, used in cpu.items()) or "—"


def stream_table(summary: dict[str, dict[str, Any]]) -> str:
    base = summary["direct"]
    rows = []
    for name, s in summary.items():
        rows.append([
            name, fmt(s["ttft_p50_ms"], ".2f"), fmt(s["ttft_p99_ms"], ".2f"),
            fmt(s["ttft_p50_ms"] - base["ttft_p50_ms"], ".2f", sign=True),
            fmt(s["paired_added_ttft_p50_ms"], ".2f", sign=True),
            fmt(s["p50_ms"], ".1f"), fmt(s["p50_ms"] - base["p50_ms"], ".1f", sign=True),
            fmt(s["paired_added_p50_ms"], ".1f", sign=True),
            fmt(s.get("net_p50_ms", math.nan) - base.get("net_p50_ms", math.nan), ".2f",
                sign=True),
            fmt(s.get("paired_added_net_p50_ms", math.nan), ".2f", sign=True),
            str(s["chunks_min"]), cpu_cell(s), str(s["errors"]),
        ])
    return md_table(["target", "TTFT p50 ms", "TTFT p99 ms", "added TTFT p50",
                     "paired added TTFT p50", "total p50 ms", "added total p50",
                     "paired added total p50", "added net p50", "paired added net p50",
                     "min chunks", "relay CPU ms/stream", "errors"],
                    rows)


def cold_summary(runs: dict[str, list[ColdRun]]) -> dict[str, Any]:
    medians = {name: ms(percentile([r.ttft_s for r in rs], 0.5)) for name, rs in runs.items()}
    return {
        name: {
            "runs_ms": rounded_ms([r.ttft_s for r in rs]),
            "median_ms": medians[name],
            "overhead_ms": medians[name] - medians["bare"],
            "ready_runs_ms": rounded_ms([r.ready_s for r in rs]),
            "ready_median_ms": ms(percentile([r.ready_s for r in rs], 0.5)),
        }
        for name, rs in runs.items()
    }


def cold_table(cold: dict[str, Any]) -> str:
    rows = [[name, fmt(c["median_ms"]), fmt(c["overhead_ms"], ".1f", sign=True),
             fmt(c["ready_median_ms"]), " ".join(f"{x:.0f}" for x in c["runs_ms"])]
            for name, c in cold.items()]
    return md_table(["path", "median ms to 1st token", "overhead vs bare",
                     "spawn → ready ms", "runs ms"], rows)


def verdicts(results: dict[str, Any]) -> list[str]:
    """Each target of GOALS, and "ahead of the router" on every row when it ran."""
    w, lines = results["workloads"], []

    def check(label: str, value: float, ok: bool) -> None:
        lines.append(f"- {label}: {fmt(value, '.3f')} → {'PASS' if ok else 'FAIL'}")

    def added(workload: str, name: str, key: str = "p50_ms") -> float:
        per_target = w[workload]
        return float(per_target[name][key] - per_target["direct"][key])

    def ratio(workload: str, name: str) -> float:
        per_target = w[workload]
        return float(per_target[name]["rps"] / per_target["direct"]["rps"])

    rows: list[tuple[str, Callable[[str], float], bool]] = [  # label, value, higher is better
        ("added p50 at concurrency 1, ms", lambda n: added("chat_1tok_c1", n), False),
        (f"req/s ratio at concurrency {results['args']['concurrency']}",
         lambda n: ratio("chat_1tok_cN", n), True),
    ]
    if "chat_1tok_wide" in w:
        rows.append((f"req/s ratio at concurrency {results['args']['wide_concurrency']}",
                     lambda n: ratio("chat_1tok_wide", n), True))
    net = all("net_p50_ms" in s for s in w["stream"].values())
    rows.append((f"{results['args']['stream_tokens']}-token stream: added total p50"
                 f"{' (net of the server time)' if net else ''}, ms",
                 lambda n: added("stream", n, "net_p50_ms" if net else "p50_ms"), False))
    cold = results.get("cold", {})
    if "modelyard" in cold:
        rows.append(("cold load → first token: added, ms",
                     lambda n: float(cold[n]["overhead_ms"]), False))
    goals = [GOALS["added_p50_c1_ms"], GOALS["ratio_c8"], GOALS["ratio_wide"],
             GOALS["stream_added_total_ms"], GOALS["cold_overhead_ms"]]
    if "chat_1tok_wide" not in w:
        goals.remove(GOALS["ratio_wide"])
    for (label, value, higher), goal in zip(rows, goals, strict=False):
        mine = value("modelyard")
        check(f"modelyard {label} {'≥' if higher else '≤'} {goal:g}", mine,
              mine >= goal if higher else mine <= goal)
    errors = sum(per_target["modelyard"]["errors"] for per_target in w.values())
    check("modelyard failed requests = 0", errors, errors == 0)
    if "router" in w["chat_1tok_c1"]:
        for label, value, higher in rows:
            if label.startswith("cold") and "router" not in cold:
                continue
            mine, peer = value("modelyard"), value("router")
            if "stream" in label:  # issue 33: a stream's added total within 5 ms of the router's
                slack = GOALS["stream_vs_router_ms"]
                check(f"within {slack:g} ms of the router: {label} (router {fmt(peer, '.3f')})",
                      mine, mine <= peer + slack)
                continue
            check(f"ahead of the router: {label} (router {fmt(peer, '.3f')})", mine,
                  mine > peer if higher else mine < peer)
    return lines


def busy_warning(busy_pct: float) -> list[str]:
    if busy_pct < 15:
        return []
    return [f"WARNING: other processes used {busy_pct:.0f}% of the CPUs just before the run; "
            "the absolute numbers are noisy (the interleaving keeps the comparison fair)."]


def backend_bound_note(w: dict[str, Any]) -> list[str]:
    c1, cn = w["chat_1tok_c1"]["direct"]["rps"], w["chat_1tok_cN"]["direct"]["rps"]
    if not cn < c1:
        return []
    return [f"note: llama-server itself is slower at this concurrency ({cn:.1f} req/s) than "
            f"alone ({c1:.1f} req/s), so this ratio barely sees relay costs; "
            "`--llama-args='-np 4 -no-kvu'` gives all three a backend that scales."]


def render(results: dict[str, Any]) -> str:
    a, w = results["args"], results["workloads"]
    parts = [
        f"# modelyard relay benchmark — {results['started_at']}",
        f"{results['machine']['cpus']} CPUs, load avg {results['machine']['loadavg_start']} → "
        f"{results['machine']['loadavg_end']}; llama-server: {results['binary']}",
        f"llama-server options in all targets: {' '.join(results['shared_llama_args'])}",
        *busy_warning(results["machine"]["busy_before_pct"]),
        "",
        f"## 1-token chat completions, concurrency 1 ({a['requests']} per target)",
        request_table(w["chat_1tok_c1"]),
        "",
        f"## 1-token chat completions, concurrency {a['concurrency']} "
        f"({a['concurrent_requests']} per target, batches of {a['batch']})",
        request_table(w["chat_1tok_cN"]),
        *backend_bound_note(w),
        "",
        *([f"## 1-token chat completions, concurrency {a['wide_concurrency']} "
           f"({a['wide_requests']} per target)", request_table(w["chat_1tok_wide"]), ""]
          if "chat_1tok_wide" in w else []),
        f"## {a['stream_tokens']}-token streams, concurrency 1 ({a['streams']} per target)",
        stream_table(w["stream"]),
        "net: a stream's total less llama-server's own time for it (its final chunk's "
        "`timings`: prompt + generation), so the generation's spread cancels out",
    ]
    if results.get("cold"):
        parts += ["", f"## Cold load: request → first token ({a['cold_repeats']} runs each; "
                  "bare = spawn llama-server, poll /health every 5 ms, request)",
                  cold_table(results["cold"]),
                  "spawn → ready: bare's own /health poll; modelyard's engine load_duration_s"]
    for note in results["notes"]:
        parts.append(f"\nnote: {note}")
    parts += ["", "## Goals", *verdicts(results), "",
              f"took {results['duration_s']:.0f} s; JSON: {results['json_path']}"]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------
# Main


async def measure(inputs: Inputs, args: argparse.Namespace, results: dict[str, Any]) -> None:
    # llama-server closes a connection idle for 5 s, httpx's default expiry: a reuse race.
    width = max(64, args.wide_concurrency)
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width,
                          keepalive_expiry=3.0)
    async with httpx.AsyncClient(timeout=300.0, limits=limits, trust_env=False) as client:
        targets = await start_targets(client, inputs, args, results["notes"])
        try:
            step("warming up")
            await warm_up(client, targets, args.warmup, args.concurrency)
            for target in targets:
                target.cpu = relay_processes(target)
            results["llama_server_argv"] = {t.name: llama_server_cmdlines(t) for t in targets}
            w = results["workloads"]
            step(f"1-token, concurrency 1: {args.requests} x {len(targets)}")
            w["chat_1tok_c1"] = await serial_1tok(client, targets, args.requests)
            step(f"1-token, concurrency {args.concurrency}: {args.concurrent_requests} x "
                 f"{len(targets)}")
            w["chat_1tok_cN"] = await concurrent_1tok(
                client, targets, args.concurrent_requests, args.concurrency, args.batch)
            if args.wide_concurrency > 0:
                step(f"1-token, concurrency {args.wide_concurrency}: {args.wide_requests} x "
                     f"{len(targets)}")
                w["chat_1tok_wide"] = await concurrent_1tok(
                    client, targets, args.wide_requests, args.wide_concurrency,
                    2 * args.wide_concurrency)
            step(f"{args.stream_tokens}-token streams: {args.streams} x {len(targets)}")
            w["stream"] = await streams(client, targets, args.streams, args.stream_tokens)
            for key, per_target in w.items():
                base = per_target["direct"] if key in PAIRED else None
                w[key] = {name: summarize(s, base) for name, s in per_target.items()}
        finally:
            for target in targets:
                target.proc.stop()
        if args.cold_repeats > 0:
            with_router = "router" in results["llama_server_argv"]
            step(f"cold loads: {args.cold_repeats} x {2 + with_router}")
            try:
                results["cold"] = cold_summary(await cold_loads(client, inputs, args, with_router))
            except (RuntimeError, TimeoutError) as exc:
                results["notes"].append(f"cold loads failed: {exc}")


_T0 = time.monotonic()


def step(what: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f} s] {what}", flush=True)


def json_safe(value: Any) -> Any:
    """NaN (a statistic of nothing) becomes null: strict JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_json(results: dict[str, Any], stamp: str, bench: str = "proxy") -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{bench}-{stamp}.json"
    path.write_text(json.dumps(json_safe(results), indent=1, default=str))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    stamp = time.strftime("%Y%m%d-%H%M%S")
    inputs = Inputs(
        find_binary(args), find_model(args), args.ctx_size,
        Path(tempfile.mkdtemp(prefix="modelyard-bench-")), tuple(shlex.split(args.llama_args)),
    )
    results: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args),
        "binary": str(inputs.binary), "model": str(inputs.model),
        "shared_llama_args": inputs.shared_args(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "loadavg_start": loadavg(),
                    "busy_before_pct": psutil.cpu_percent(interval=1.0)},
        "workloads": {}, "notes": [],
    }
    step(f"logs in {inputs.workdir}")
    ok = False
    try:
        asyncio.run(measure(inputs, args, results))
        ok = True
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        stop_all()
        if ok and not args.keep_workdir:
            shutil.rmtree(inputs.workdir, ignore_errors=True)
        elif not ok:
            print(f"logs kept in {inputs.workdir}", file=sys.stderr)
    results["machine"]["loadavg_end"] = loadavg()
    results["duration_s"] = time.monotonic() - _T0
    results["json_path"] = str(RESULTS_DIR / f"proxy-{stamp}.json")
    write_json(results, stamp)
    print("\n" + render(results))
    return 0


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
