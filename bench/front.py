"""What the front itself costs: CPU per request of modelyard against the cheapest Python relay
(`floor`: bench/floor_relay.py, uvicorn + aiohttp and nothing else), both in front of the fake
llama-server (tests/fakes/fake_backend.py, a real process), so no model competes for the cores.

    make bench-front                      # defaults: about 3-4 minutes on 2 cores
    .venv/bin/python bench/front.py --help

Targets, all on loopback, one driven at a time, interleaved in rounds so load drift hits all:
- `floor`: the floor relay in front of a fake backend (a second pair serves the paced streams);
- `modelyard`: `modelyard serve` with the default features (front and engine processes; the
  engine runs the fakes as `openai` models, as the tests do);
- `modelyard-features`: the same with auth required (an API token sent as Bearer), a configured
  requests-per-minute limit on that token (too high to refuse anything, but counted), usage and
  activity (always on: every request ends as a record both read).

The bench's client is aiohttp (httpx would be slower than the floor). Workloads at
`--concurrency` (16): a 1-token chat, an embedding and a `--stream-tokens` (64)
stream; then `--paced-streams` (64) streams at once, paced by the fake's `--tokens-per-s`, for
the relay's CPU per streamed chunk; then requests/s at saturation for modelyard with 1 and 2
workers (`serve --workers N`, where this modelyard has it). The CPU of a target is read from
/proc for its own processes (floor: the relay; modelyard: the front's processes and the
engine's, not the fake backends doing the model's work) over the rounds that drove it.

Printed as markdown tables with each target's CPU as a multiple of the floor's, against issue
33's target (at most 1.3x, per request and per chunk); written to
bench/results/front-<timestamp>.json. Exits 0 whether the targets are met or not; 1 when a
request failed (the bench itself did not work).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import platform
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

import aiohttp
import httpx
import orjson
import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.proxy import (
    HOST,
    MESSAGES,
    RESULTS_DIR,
    ROOT,
    Drive,
    Proc,
    RequestFailed,
    Samples,
    Target,
    busy_warning,
    fmt,
    has_content,
    interleaved,
    is_200,
    is_healthy,
    loadavg,
    md_table,
    pool,
    spawn_serve,
    step,
    stop_all,
    summarize,
    wait_until,
    write_json,
)
from modelyard.engine.backends.openai_server import free_port

FAKE_BACKEND = ROOT / "tests" / "fakes" / "fake_backend.py"
MODEL, PACED_MODEL = "fake", "fake-paced"
EMBED_PATH = "/v1/embeddings"
TARGET_RATIO = 1.3  # issue 33: the front's CPU per request and per chunk ≤ 1.3x the floor's
FLOOR = "floor"
TWO_WORKERS = "modelyard-2-workers"
WORKLOADS = {"chat": "1-token chat", "embedding": "embedding", "stream": "stream"}


# --------------------------------------------------------------------------------------------
# Options


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--chats", type=int, default=3000, help="1-token chats per target")
    p.add_argument("--embeddings", type=int, default=3000, help="embeddings per target")
    p.add_argument("--streams", type=int, default=800, help="streams per target")
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=80,
                   help="requests per target per interleaved round")
    p.add_argument("--paced-streams", type=int, default=64,
                   help="streams at once for the CPU per chunk (0: skip)")
    p.add_argument("--paced-rounds", type=int, default=5,
                   help="rounds of --paced-streams streams per target")
    p.add_argument("--tokens-per-s", type=float, default=32.0,
                   help="each paced stream's rate (the fake's --tokens-per-s)")
    p.add_argument("--saturation-requests", type=int, default=3000,
                   help="1-token chats per target at --saturation-concurrency (0: skip)")
    p.add_argument("--saturation-concurrency", type=int, default=64)
    p.add_argument("--warmup", type=int, default=32, help="unmeasured requests per target")
    p.add_argument("--no-features", action="store_true",
                   help="leave out the modelyard-features target")
    p.add_argument("--keep-workdir", action="store_true", help="keep the temp dir with the logs")
    args = p.parse_args(argv)
    for name in ("concurrency", "batch", "stream_tokens", "saturation_concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be 1 or more")
    return args


# --------------------------------------------------------------------------------------------
# Targets


@dataclass
class Front(Target):
    """A target: where its requests go, what it is sent with, and whose CPU it is charged."""

    paced_url: str = ""  # the paced streams' relay (modelyard: the same, another model)
    headers: dict[str, str] = field(default_factory=dict)
    others: list[Proc] = field(default_factory=list)  # its other processes (stopped with it)
    roles: dict[str, list[psutil.Process]] = field(default_factory=dict)
    session: aiohttp.ClientSession | None = None  # the bench's client to it

    def cpu_s(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for role, procs in self.roles.items():
            out[role] = 0.0
            for p in procs:
                try:
                    t = p.cpu_times()
                except psutil.Error:
                    continue
                out[role] += t.user + t.system
        return out

    def open(self, width: int) -> None:
        # Idle connections go after 2 s: the servers close theirs after 5 (uvicorn's default,
        # client_keep_alive_s), and a round of the other targets can take longer than that:
        # reusing one the server closed meanwhile fails the request.
        self.session = aiohttp.ClientSession(
            headers=self.headers, timeout=aiohttp.ClientTimeout(total=120.0),
            connector=aiohttp.TCPConnector(limit=width, keepalive_timeout=2.0))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def paced(self) -> Front:
        return dataclasses.replace(self, url=self.paced_url)

    def stop(self) -> None:
        for proc in [self.proc, *self.others]:
            proc.stop()


def roles_of(proc: Proc) -> dict[str, list[psutil.Process]]:
    """modelyard's processes by role: `engine` the `--engine-only` ones, `front` the rest
    (workers too); the fake backends, doing the model's work, are nobody's."""
    roles: dict[str, list[psutil.Process]] = {
        "front": [psutil.Process(proc.popen.pid)], "engine": []}
    for child in proc.descendants():
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if any(arg.endswith("fake_backend.py") for arg in argv):
            continue
        roles["engine" if "--engine-only" in argv else "front"].append(child)
    return roles


def fake_argv(*flags: str) -> list[str]:
    return [sys.executable, str(FAKE_BACKEND), "--alias", MODEL, "--embeddings", *flags]


def paced_flags(args: argparse.Namespace) -> tuple[str, ...]:
    return ("--tokens-per-s", f"{args.tokens_per_s:g}")


async def start_floor(
    client: httpx.AsyncClient, workdir: Path, args: argparse.Namespace
) -> Front:
    """Two fakes (as fast as they go; paced) and a floor relay in front of each."""
    procs, urls = [], []
    for tag, flags in (("", ()), ("-paced", paced_flags(args))):
        port = free_port()
        fake = Proc(f"fake{tag}", [*fake_argv(*flags), "--host", HOST, "--port", str(port)],
                    workdir / f"fake{tag}.log")
        procs.append(fake)
        await wait_until(client, f"http://{HOST}:{port}/health", fake, is_200)
        port, upstream = free_port(), f"http://{HOST}:{port}"
        relay = Proc(f"floor{tag}", [sys.executable, str(ROOT / "bench" / "floor_relay.py"),
                                     str(port), upstream], workdir / f"floor{tag}.log")
        procs.append(relay)
        urls.append(f"http://{HOST}:{port}")
        await wait_until(client, urls[-1] + "/health", relay, is_200)
    relays = [psutil.Process(p.popen.pid) for p in procs[1::2]]
    return Front(FLOOR, urls[0], procs[1], paced_url=urls[1], others=[procs[0], *procs[2:]],
                 roles={"front": relays})


def modelyard_config(args: argparse.Namespace, *, features: bool) -> dict[str, Any]:
    def model(model_id: str, *flags: str) -> dict[str, Any]:
        argv = [*fake_argv(*flags), "--host", "$host", "--port", "$port",
                "--api-key-file", "$api_key_file"]
        # Every stream runs at once, as through the floor (which has no queue).
        return {"id": model_id, "backend": "openai", "argv": argv,
                "max_concurrency": args.paced_streams + args.saturation_concurrency}
    config: dict[str, Any] = {
        "scan_hf_cache": False, "devices": "cpu", "embedding_demo": False,
        "models": [model(MODEL), model(PACED_MODEL, *paced_flags(args))],
    }
    if features:
        config["auth"] = "required"
    return config


async def start_modelyard(
    client: httpx.AsyncClient, workdir: Path, args: argparse.Namespace, name: str,
    *options: str, features: bool = False,
) -> Front:
    home = workdir / name
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.yaml").write_text(yaml.safe_dump(modelyard_config(args, features=features)))
    proc, url = spawn_serve(workdir, home, name, *options)
    front = Front(name, url, proc, paced_url=url)
    await wait_until(client, url + "/health", proc, is_healthy)
    if features:
        front.headers = await token_with_limit(client, url, home)
    return front


async def token_with_limit(client: httpx.AsyncClient, url: str, home: Path) -> dict[str, str]:
    """An inference token (the admin's, made with the CLI's token first boot wrote) held to a
    requests-per-minute limit nothing here reaches: every request is counted against it."""
    admin = {"Authorization": f"Bearer {(home / 'cli-token').read_text().strip()}"}
    r = await client.post(url + "/tokens", headers=admin,
                          json={"name": "bench-front", "scopes": ["inference"]})
    r.raise_for_status()
    token = r.json()
    r = await client.put(f"{url}/admin/limits/token:{token['id']}", headers=admin,
                         json={"requests_per_minute": 10**9})
    r.raise_for_status()
    return {"Authorization": f"Bearer {token['token']}"}


def workers_supported() -> bool:
    """Whether this modelyard has `serve --workers N` (issue 33 adds it)."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    done = subprocess.run([sys.executable, "-m", "modelyard", "serve", "--help"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    return "--workers" in done.stdout


# --------------------------------------------------------------------------------------------
# Requests and workloads


def chat_payload(model: str = MODEL, *, max_tokens: int = 1, stream: bool = False) -> bytes:
    body: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens}
    if stream:
        body["stream"] = True
    return orjson.dumps(body)


EMBED_PAYLOAD = orjson.dumps({"model": MODEL, "input": MESSAGES[0]["content"]})


# aiohttp, not httpx, drives the targets: at concurrency 16 one httpx client tops out near 200
# requests a second on this machine (aiohttp: 1,300), at 64 below 100, so the client, not the
# target, would set the pace (and the saturation figures).
JSON = {"content-type": "application/json"}
CHAT_PATH = "/v1/chat/completions"
Send = Callable[[aiohttp.ClientSession, str, bytes, Samples], Awaitable[None]]


async def send(session: aiohttp.ClientSession, url: str, payload: bytes, s: Samples) -> None:
    """One request; its latency, or its failure, in `s`."""
    start = time.perf_counter()
    try:
        async with session.post(url, data=payload, headers=JSON) as r:
            body = await r.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        s.failed(RequestFailed(f"{url}: {type(exc).__name__}: {exc}"))
        return
    if r.status != 200:
        s.failed(RequestFailed(f"{url}: HTTP {r.status}: {body[:300]!r}"))
        return
    s.latencies_s.append(time.perf_counter() - start)


async def send_stream(
    session: aiohttp.ClientSession, url: str, payload: bytes, s: Samples
) -> None:
    """One SSE request; to its first content chunk, to its end and its chunks (every `data:`
    event but [DONE]: what the relay passed on) in `s`."""
    start, ttft, chunks = time.perf_counter(), math.nan, 0
    try:
        async with session.post(url, data=payload, headers=JSON) as r:
            if r.status != 200:
                raise RequestFailed(f"{url}: HTTP {r.status}: {(await r.read())[:300]!r}")
            async for raw in r.content:
                line = raw.decode().rstrip()
                if line.startswith("data:") and not line.endswith("[DONE]"):
                    chunks += 1
                    if math.isnan(ttft) and has_content(line):
                        ttft = time.perf_counter() - start
    except (aiohttp.ClientError, TimeoutError) as exc:
        s.failed(RequestFailed(f"{url}: {type(exc).__name__}: {exc}"), stream=True)
        return
    except RequestFailed as exc:
        s.failed(exc, stream=True)
        return
    if math.isnan(ttft):
        s.failed(RequestFailed(f"{url}: the stream ended without content"), stream=True)
        return
    s.latencies_s.append(time.perf_counter() - start)
    s.ttft_s.append(ttft)
    s.chunks.append(chunks)


def requests_of(payload: bytes, concurrency: int, path: str = CHAT_PATH) -> Drive:
    """A round of `size` requests at `concurrency`."""
    return sent_by(send, payload, concurrency, path)


def streams_of(payload: bytes, concurrency: int) -> Drive:
    return sent_by(send_stream, payload, concurrency, CHAT_PATH)


def sent_by(how: Send, payload: bytes, concurrency: int, path: str) -> Drive:
    async def drive(target: Target, s: Samples, size: int) -> None:
        assert isinstance(target, Front) and target.session is not None
        session, url = target.session, target.url + path
        await pool(size, concurrency, lambda: how(session, url, payload, s))
    return drive


async def warm_up(fronts: Sequence[Front], args: argparse.Namespace) -> None:
    """Connections opened, both models loaded, the caches of every path filled."""
    n, c = max(1, args.warmup), args.concurrency
    for front in fronts:
        s = Samples()
        await requests_of(chat_payload(), c)(front, s, n)
        await requests_of(EMBED_PAYLOAD, c, EMBED_PATH)(front, s, n)
        await streams_of(chat_payload(max_tokens=8, stream=True), c)(front, s, c)
        await streams_of(chat_payload(PACED_MODEL, max_tokens=2, stream=True), c)(
            front.paced(), s, c)
        if s.errors:
            raise RuntimeError(f"{front.name} failed in the warm-up: {s.errors[0]}")
        if front.name != FLOOR:
            front.roles = roles_of(front.proc)


async def workloads(fronts: Sequence[Front], args: argparse.Namespace) -> dict[str, Any]:
    c, batch, out = args.concurrency, args.batch, {}
    step(f"1-token chats, concurrency {c}: {args.chats} x {len(fronts)}")
    out["chat"] = await interleaved(fronts, args.chats, batch, requests_of(chat_payload(), c))
    step(f"embeddings, concurrency {c}: {args.embeddings} x {len(fronts)}")
    out["embedding"] = await interleaved(fronts, args.embeddings, batch,
                                         requests_of(EMBED_PAYLOAD, c, EMBED_PATH))
    step(f"{args.stream_tokens}-token streams, concurrency {c}: {args.streams} x {len(fronts)}")
    out["stream"] = await interleaved(
        fronts, args.streams, batch,
        streams_of(chat_payload(max_tokens=args.stream_tokens, stream=True), c))
    summary: dict[str, Any] = {k: {name: summarize(s) for name, s in per_target.items()}
                               for k, per_target in out.items()}
    if args.paced_streams > 0:
        k = args.paced_streams
        step(f"paced streams, {k} at once at {args.tokens_per_s:g} tokens/s: "
             f"{args.paced_rounds} rounds x {len(fronts)}")
        payload = chat_payload(PACED_MODEL, max_tokens=args.stream_tokens, stream=True)
        paced = await interleaved([f.paced() for f in fronts], k * args.paced_rounds, k,
                                  streams_of(payload, k))
        summary["paced"] = {name: per_chunk(s) for name, s in paced.items()}
    return summary


def per_chunk(s: Samples) -> dict[str, Any]:
    """A paced run's summary, with its CPU per streamed chunk by process role."""
    out = summarize(s)
    chunks = sum(s.chunks)
    out["chunks"] = chunks
    if chunks:
        out["cpu_us_per_chunk"] = {role: used * 1e6 / chunks for role, used in s.cpu_s.items()}
    return out


async def saturation(
    client: httpx.AsyncClient, fronts: Sequence[Front], workdir: Path, args: argparse.Namespace,
    with_workers: bool,
) -> dict[str, Any]:
    """1-token chats at --saturation-concurrency: the floor, modelyard as it runs (1 worker) and,
    where `serve --workers` exists, a modelyard with 2 workers, interleaved."""
    targets = [f for f in fronts if f.name in (FLOOR, "modelyard")]
    two: Front | None = None
    if with_workers:
        two = await start_modelyard(client, workdir, args, TWO_WORKERS,
                                    "--workers", "2")
        targets.append(two)
    try:
        if two is not None:
            two.open(args.saturation_concurrency)
            await warm_up([two], args)
        c = args.saturation_concurrency
        step(f"saturation, concurrency {c}: {args.saturation_requests} x {len(targets)}")
        runs = await interleaved(targets, args.saturation_requests, max(args.batch, 2 * c),
                                 requests_of(chat_payload(), c))
    finally:
        if two is not None:
            await two.close()
            two.stop()
    return {name: summarize(s) for name, s in runs.items()}


# --------------------------------------------------------------------------------------------
# Report


def total(cpu: dict[str, float] | None) -> float:
    return sum((cpu or {}).values()) if cpu else float("nan")


def ratios(summary: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each workload's CPU (per request; paced: per chunk), every target over the floor's."""
    out: dict[str, dict[str, float]] = {}
    for workload, per_target in summary.items():
        key = "cpu_us_per_chunk" if workload == "paced" else "cpu_ms_per_request"
        floor = total(per_target[FLOOR].get(key))
        out[workload] = {name: total(s.get(key)) / floor if floor > 0 else float("nan")
                         for name, s in per_target.items()}
    return out


def times(ratio: float) -> str:
    """A ratio to the floor, or n/a: at small counts the floor's CPU can read 0 (/proc counts
    in clock ticks, 10 ms each), and nothing is measured then."""
    return "n/a" if math.isnan(ratio) else f"{ratio:.2f}x"


def cpu_cells(cpu: dict[str, float] | None, spec: str) -> list[str]:
    """front, engine and total, `—` for a role the target does not have."""
    cpu = cpu or {}
    roles = [fmt(cpu["front"], spec) if "front" in cpu else "—",
             fmt(cpu["engine"], spec) if "engine" in cpu else "—"]
    return [*roles, fmt(total(cpu), spec)]


def request_table(summary: dict[str, Any], ratio: dict[str, dict[str, float]],
                  args: dict[str, Any]) -> str:
    rows = []
    for workload, label in WORKLOADS.items():
        if workload == "stream":
            label = f"{args['stream_tokens']}-token stream"
        for name, s in summary[workload].items():
            rows.append([label, name, fmt(s["rps"]), fmt(s["p50_ms"], ".2f"),
                         *cpu_cells(s.get("cpu_ms_per_request"), ".3f"),
                         times(ratio[workload][name]), str(s["errors"])])
    return md_table(["workload", "target", "req/s", "p50 ms", "front CPU ms", "engine CPU ms",
                     "total CPU ms", "vs floor", "errors"], rows)


def chunk_table(paced: dict[str, Any], ratio: dict[str, float]) -> str:
    rows = [[name, str(s["n"]), str(s["chunks"]), *cpu_cells(s.get("cpu_us_per_chunk"), ".1f"),
             times(ratio[name]), str(s["errors"])] for name, s in paced.items()]
    return md_table(["target", "streams", "chunks", "front CPU µs", "engine CPU µs",
                     "total CPU µs", "vs floor", "errors"], rows)


def saturation_table(sat: dict[str, Any], with_workers: bool) -> str:
    rows = []
    for name, s in sat.items():
        workers = {FLOOR: "—", TWO_WORKERS: "2"}.get(name, "1")
        shown = "modelyard" if name == TWO_WORKERS else name
        rows.append([shown, workers, fmt(s["rps"]), fmt(s["p50_ms"], ".2f"),
                     fmt(s["p99_ms"], ".2f"), fmt(total(s.get("cpu_ms_per_request")), ".3f"),
                     str(s["errors"])])
    if not with_workers:
        rows.append(["modelyard", "2", "n/a (no --workers)", "—", "—", "—", "—"])
    return md_table(["target", "workers", "req/s", "p50 ms", "p99 ms", "CPU ms/req", "errors"],
                    rows)


def verdicts(ratio: dict[str, dict[str, float]], args: dict[str, Any]) -> list[str]:
    """Every target's CPU against the floor's, each workload: met or not met."""
    labels = {**WORKLOADS, "stream": f"{args['stream_tokens']}-token stream",
              "paced": f"per streamed chunk ({args['paced_streams']} paced streams)"}
    lines = []
    for workload, per_target in ratio.items():
        for name, value in per_target.items():
            if name == FLOOR:
                continue
            unit = "chunk" if workload == "paced" else "request"
            if math.isnan(value):
                lines.append(f"- {name}, {labels[workload]}: CPU per {unit} not measured (the "
                             "floor's CPU read 0 at these counts: raise them) → n/a")
                continue
            met = value <= TARGET_RATIO
            lines.append(f"- {name}, {labels[workload]}: CPU per {unit} {value:.2f}x "
                         f"the floor's (target ≤ {TARGET_RATIO:g}x) → "
                         f"{'met' if met else 'NOT MET'}")
    return lines


def failures(results: dict[str, Any]) -> int:
    """Requests that failed in any measured workload."""
    groups = [*results["workloads"].values(), results.get("saturation", {})]
    return sum(s["errors"] for per_target in groups for s in per_target.values())


def render(results: dict[str, Any]) -> str:
    a, w, m = results["args"], results["workloads"], results["machine"]
    ratio = ratios(w)
    parts = [
        f"# modelyard front benchmark — {results['started_at']}",
        f"{m['cpus']} CPUs, load avg {m['loadavg_start']} → {m['loadavg_end']}; fake backend, "
        f"concurrency {a['concurrency']}",
        *busy_warning(m["busy_before_pct"]),
        "",
        f"## CPU per request, concurrency {a['concurrency']} ({a['chats']} chats, "
        f"{a['embeddings']} embeddings, {a['streams']} streams per target)",
        request_table(w, ratio, a),
    ]
    if "paced" in w:
        parts += ["", f"## CPU per streamed chunk: {a['paced_streams']} streams at once, "
                  f"{a['tokens_per_s']:g} tokens/s each, {a['stream_tokens']} tokens",
                  chunk_table(w["paced"], ratio["paced"])]
    if "saturation" in results:
        parts += ["", f"## Saturation: 1-token chats at concurrency "
                  f"{a['saturation_concurrency']} ({a['saturation_requests']} per target)",
                  saturation_table(results["saturation"], results["workers_supported"])]
    bad = failures(results)
    parts += ["", f"## Targets (issue 33: CPU ≤ {TARGET_RATIO:g}x the floor's)",
              *verdicts(ratio, a),
              *([f"\n{bad} requests FAILED: the bench did not measure what it says"]
                if bad else []),
              "", f"took {results['duration_s']:.0f} s; JSON: {results['json_path']}"]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------
# Main


async def measure(workdir: Path, args: argparse.Namespace, results: dict[str, Any]) -> None:
    width = max(args.concurrency, args.paced_streams, args.saturation_concurrency)
    # httpx for the set-up only (health polls, the token): aiohttp drives the workloads
    async with httpx.AsyncClient(timeout=120.0, trust_env=False) as setup:
        step("starting the targets")
        fronts = [await start_floor(setup, workdir, args),
                  await start_modelyard(setup, workdir, args, "modelyard")]
        if not args.no_features:
            fronts.append(await start_modelyard(setup, workdir, args, "modelyard-features",
                                                features=True))
        try:
            for front in fronts:
                front.open(width)
            step("warming up")
            await warm_up(fronts, args)
            results["workloads"] = await workloads(fronts, args)
            if args.saturation_requests > 0:
                results["saturation"] = await saturation(
                    setup, fronts, workdir, args, results["workers_supported"])
        finally:
            for front in fronts:
                await front.close()
                front.stop()


def main(argv: Sequence[str] | None = None) -> int:
    started, args = time.monotonic(), parse_args(argv)
    # TERM too stops the servers this started (as Ctrl-C), even if started with SIGINT ignored
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.default_int_handler)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    workdir = Path(tempfile.mkdtemp(prefix="modelyard-bench-front-"))
    results: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "loadavg_start": loadavg(),
                    "busy_before_pct": psutil.cpu_percent(interval=1.0)},
        "workers_supported": args.saturation_requests > 0 and workers_supported(),
    }
    step(f"logs in {workdir}")
    ok = False
    try:
        asyncio.run(measure(workdir, args, results))
        ok = True
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        stop_all()
        if ok and not args.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not ok:
            print(f"logs kept in {workdir}", file=sys.stderr)
    results["machine"]["loadavg_end"] = loadavg()
    results["duration_s"] = time.monotonic() - started
    results["json_path"] = str(RESULTS_DIR / f"front-{stamp}.json")
    write_json(results, stamp, "front")
    print("\n" + render(results))
    return 1 if failures(results) else 0


if __name__ == "__main__":
    sys.exit(main())
