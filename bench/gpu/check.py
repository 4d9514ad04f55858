"""The GPU check's steps (scripts/gpu-check.sh runs this after the set-up): what modelyard does on
a real NVIDIA GPU, measured, each step within its own time budget and written as it ends.

    python bench/gpu/check.py --out OUTDIR --kit gpu-kit --work /tmp/gpu-check \
        [--binary LLAMA_SERVER | --build-dir DIR] [--dry-run] [--deadline-s 520]

Steps (in this order; one that the time left cannot hold is `not_run`):

* standins — random-weight models made here (bench/gpu/standins.py): the demo model's shape,
  ~0.5 B and ~3 B parameters, as GGUF and safetensors;
* memory_truth_transformers / memory_truth_gguf — each model loaded alone through modelyard:
  the engine's estimate against NVML's bytes for the serving process (or, where per-process
  readings are empty, the device's used-memory change around the load);
* batching_transformers — the transformers engine's continuous batching at 1, 8 and 32 streams;
* gpu_tests — the `gpu`-marked tests and the GPU-relevant e2e tests, on the stand-ins;
* throughput_llamacpp — llama.cpp (CUDA) direct against through modelyard at c=1, 8 and 64;
* scheduling — a helper process holds all but ~24 GiB of the GPU; stand-ins fill the rest, one
  more evicts idle ones and never runs out of memory, one larger than what is left offloads;
* swap — request → first token for a model evicted a moment ago, cold against warm.

`--dry-run` runs every step on this CPU machine with the CPU llama-server and the demo-sized
stand-in: the device readings come from the host (process RSS, host RAM) and the GPU of the
scheduling step is simulated (`simulate_gpus`), so the logic of every step runs without a GPU.
Results: OUTDIR/gpu-check.json and OUTDIR/gpu-check.md (rewritten after every step).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script
from bench.gpu import standins

ROOT = Path(__file__).resolve().parents[2]

GIB = 2**30
HOST = "127.0.0.1"


# --------------------------------------------------------------------------------------------
# Device readings: NVML on the GPU machine, the host in a dry run.


class Device:
    """Used bytes of the device and bytes per process: NVML, or the host in a dry run."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run
        self.nvml: Any = None
        if not dry_run:
            # modelyard's own NVML reader: the check runs it on a real GPU too.
            from modelyard.hw.nvml import NvmlProbe

            self.nvml = NvmlProbe()
            if not self.nvml.available():  # nvidia-smi then: device totals, no processes
                print("NVML is not available: reading nvidia-smi", flush=True)

    def _gpu(self) -> Any:
        if self.nvml.available():
            return self.nvml.devices()[0]
        from modelyard.hw.smi import query_gpus

        return query_gpus()[0]

    def describe(self) -> dict[str, Any]:
        if self.nvml is None:
            mem = psutil.virtual_memory()
            return {"name": "host (dry run)", "total_bytes": mem.total}
        info = self._gpu()
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,compute_cap",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             check=False, timeout=30).stdout.strip()
        return {"name": info.name, "total_bytes": info.total_bytes, "driver_and_cc": smi,
                "temperature_c": info.temperature_c}

    def used_bytes(self) -> int:
        if self.nvml is None:
            mem = psutil.virtual_memory()
            return mem.total - mem.available
        return int(self._gpu().used_bytes or 0)

    def free_bytes(self) -> int:
        if self.nvml is None:
            return int(psutil.virtual_memory().available)
        return int(self._gpu().free_bytes or 0)

    def process_bytes(self) -> dict[int, int]:
        """Per-process bytes (empty where the driver does not account per process)."""
        if self.nvml is None:
            out = {}
            for p in psutil.process_iter(["pid", "memory_info"]):
                with contextlib.suppress(psutil.Error, TypeError, AttributeError):
                    out[p.info["pid"]] = int(p.info["memory_info"].rss)
            return out
        if not self.nvml.available():
            return {}
        return dict(self.nvml.processes(self._gpu().index))


# --------------------------------------------------------------------------------------------
# A modelyard server and a direct llama-server, as child processes.


@dataclass
class Proc:
    argv: list[str]
    log: Path
    env: dict[str, str]
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = self.log.open("ab")
        self.popen = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                      env=self.env, start_new_session=True)
        return self

    def stop(self, grace_s: float = 15.0) -> None:
        p = self.popen
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class Server:
    """`modelyard serve` with a config of the check's own, in a home of its own."""

    def __init__(self, work: Path, name: str, config: dict[str, Any]) -> None:
        self.home = work / f"home-{name}"
        if self.home.exists():
            shutil.rmtree(self.home)
        (self.home / "models").mkdir(parents=True)
        config = {"scan_hf_cache": False, "embedding_demo": False, "home": str(self.home),
                  **config}
        (self.home / "config.yaml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        env = {**os.environ, "MODELYARD_HOME": str(self.home), "PYTHONUNBUFFERED": "1"}
        env.pop("MODELYARD_CONFIG", None)
        self.proc = Proc([sys.executable, "-m", "modelyard", "serve", "--port", str(self.port),
                          "--config", str(self.home / "config.yaml")],
                         work / f"{name}.log", env)
        self.token = ""

    async def __aenter__(self) -> Server:
        self.proc.start()
        await wait_for(lambda: get_ok(f"{self.url}/health"), 180, "modelyard healthy",
                       self.proc)
        self.token = (self.home / "cli-token").read_text().strip()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.proc.stop)

    @property
    def admin(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"}

    async def load(self, client: httpx.AsyncClient, model: str) -> None:
        r = await client.post(f"{self.url}/admin/models/{model}/load", headers=self.admin,
                              json={"keep_alive_s": 3600}, timeout=600)
        r.raise_for_status()

    async def unload(self, client: httpx.AsyncClient, model: str) -> None:
        r = await client.post(f"{self.url}/admin/models/{model}/unload", headers=self.admin,
                              timeout=300)
        r.raise_for_status()

    async def status(self, client: httpx.AsyncClient) -> Any:
        r = await client.get(f"{self.url}/status", headers=self.admin, timeout=30)
        r.raise_for_status()
        return r.json()

    async def model(self, client: httpx.AsyncClient, model: str) -> dict[str, Any] | None:
        return next((m for m in records(await self.status(client)) if m.get("model") == model),
                    None)


def records(tree: Any) -> Iterator[dict[str, Any]]:
    """Every model record (a dict with "model" and "memory") anywhere in a status document."""
    if isinstance(tree, dict):
        if "model" in tree and "memory" in tree:
            yield tree
        for v in tree.values():
            yield from records(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from records(v)


async def get_ok(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=5) as c:
            return (await c.get(url)).status_code == 200
    except httpx.HTTPError:
        return False


async def wait_for(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str,
                   proc: Proc | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return
        if proc is not None and proc.popen is not None and proc.popen.poll() is not None:
            tail = proc.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{what}: the process exited ({proc.popen.returncode}):\n{tail}")
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


# --------------------------------------------------------------------------------------------
# Load: chats at a concurrency, tokens counted from each answer's usage.


def chat_body(model: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    # ignore_eos (llama-server's and the transformers engine's extension): a random-weight
    # model generates exactly max_tokens, whatever it draws.
    return {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "Count from one to twenty in words."}]}


@dataclass
class LoadResult:
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    first_error: str | None = None

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_s)
        return {"requests": self.requests, "errors": self.errors, "tokens": self.tokens,
                "wall_s": round(self.wall_s, 3),
                "req_per_s": round(self.requests / self.wall_s, 2) if self.wall_s else None,
                "tokens_per_s": round(self.tokens / self.wall_s, 1) if self.wall_s else None,
                "p50_ms": round(1e3 * lat[len(lat) // 2], 2) if lat else None,
                "p90_ms": round(1e3 * lat[int(len(lat) * 0.9)], 2) if lat else None,
                "first_error": self.first_error}


async def drive(url: str, model: str, concurrency: int, requests: int, max_tokens: int,
                headers: dict[str, str] | None = None) -> LoadResult:
    """`requests` chats, `concurrency` at a time (a bounded loop that ends by itself)."""
    out = LoadResult()
    queue = list(range(requests))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits, headers=headers) as client:

        async def worker() -> None:
            while queue:
                queue.pop()
                t0 = time.perf_counter()
                try:
                    r = await client.post(f"{url}/v1/chat/completions",
                                          json=chat_body(model, max_tokens))
                    r.raise_for_status()
                    out.tokens += int(r.json().get("usage", {}).get("completion_tokens") or 0)
                    out.latencies_s.append(time.perf_counter() - t0)
                    out.requests += 1
                except (httpx.HTTPError, ValueError) as exc:
                    out.errors += 1
                    out.first_error = out.first_error or repr(exc)[:300]

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        out.wall_s = time.perf_counter() - t0
    return out


async def first_token_s(url: str, model: str) -> float:
    """Seconds from sending a streamed chat to its first chunk with text."""
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client, client.stream(
            "POST", f"{url}/v1/chat/completions", json=chat_body(model, 8, stream=True)) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a token")


# --------------------------------------------------------------------------------------------
# The steps.


@dataclass
class Ctx:
    args: argparse.Namespace
    device: Device
    work: Path
    models: dict[str, Path] = field(default_factory=dict)  # "0.5b-gguf" → path
    binary: Path | None = None
    # The running step's result so far: kept when the step runs out of time.
    partial: dict[str, Any] = field(default_factory=dict)

    @property
    def dry(self) -> bool:
        return bool(self.args.dry_run)

    def base_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"keep_alive_s": 3600, "max_concurrency": 64, "max_queue": 512,
                                  "llama_server_parallel": 8, "default_ctx_size": 4096,
                                  "warm_tier_bytes": 0}
        if self.binary is not None:
            config["llama_server_path"] = str(self.binary)
        if self.dry:  # two cores: small contexts, few slots
            # One thread each: two llama-servers spinning two threads each on two shared cores
            # take seconds per token.
            config.update(devices="cpu", default_ctx_size=512, llama_server_parallel=2,
                          llama_server_threads=1)
        return config


def sizes(ctx: Ctx) -> list[str]:
    return ["demo"] if ctx.dry else ["demo", "0.5b", "3b"]


async def step_standins(ctx: Ctx) -> dict[str, Any]:
    made = ctx.partial
    for size in sizes(ctx):
        for fmt in ("gguf", "st"):
            t0 = time.perf_counter()
            path = await asyncio.to_thread(standins.make, ctx.args.kit, ctx.work / "models",
                                           size, fmt)
            ctx.models[f"{size}-{fmt}"] = path
            made[f"{size}-{fmt}"] = {"path": str(path), "seconds": round(time.perf_counter()
                                                                         - t0, 1),
                                     "parameters": standins.SHAPES[size].parameters()}
    return made


def model_entry(ctx: Ctx, key: str, **extra: Any) -> dict[str, Any]:
    path = ctx.models[key]
    if key.endswith("-gguf"):
        return {"id": key, "backend": "llamacpp", "path": str(path), **extra}
    return {"id": key, "backend": "transformers", "path": str(path), "runtime": "transformers",
            **extra}


async def memory_truth(ctx: Ctx, fmt: str) -> dict[str, Any]:
    keys = [f"{s}-{fmt}" for s in sizes(ctx) if s != "demo" or ctx.dry]
    config = {**ctx.base_config(), "models": [model_entry(ctx, k) for k in keys]}
    rows = ctx.partial
    async with Server(ctx.work, f"memory-{fmt}", config) as server, \
            httpx.AsyncClient() as client:
        # The first model twice: what its second unload leaves is a leak, what only the first
        # leaves is the process's one-time cost (a CUDA context, cuBLAS's workspaces).
        for key in [keys[0], *keys]:
            row_key = key if key not in rows else f"{key} (again)"
            before = ctx.device.used_bytes()
            procs_before = ctx.device.process_bytes()
            await server.load(client, key)
            rec = await server.model(client, key) or {}
            loaded = ctx.device.used_bytes()
            r = await client.post(f"{server.url}/v1/chat/completions",
                                  json=chat_body(key, 16), timeout=300)
            r.raise_for_status()
            rec = await server.model(client, key) or rec
            pid = rec.get("pid")
            per_process = ctx.device.process_bytes()
            # What every process gained (an in-process backend grows the engine, a child server
            # is new): NVML's per-process view of this load.
            grown = sum(max(0, b - procs_before.get(p, 0)) for p, b in per_process.items())
            memory = rec.get("memory") or {}
            estimate = memory.get("estimate_bytes")
            row = {"estimate_bytes": estimate, "reserved_bytes": memory.get("reserved_bytes"),
                   "measured_bytes": memory.get("measured_bytes"), "pid": pid,
                   "placement": rec.get("placement"),
                   "process_bytes": per_process.get(pid) if pid else None,
                   "processes_grew_bytes": grown if per_process else None,
                   "per_process_readings": bool(per_process),
                   "device_delta_load_bytes": loaded - before,
                   "device_delta_after_request_bytes": ctx.device.used_bytes() - before}
            truth = (row["processes_grew_bytes"] if not ctx.dry else row["process_bytes"]) \
                or row["device_delta_after_request_bytes"]
            row["truth"] = "per-process" if truth != row["device_delta_after_request_bytes"] \
                else "device delta"
            if estimate and truth:
                row["estimate_over_truth"] = round(estimate / truth, 3)
            rows[row_key] = row
            await server.unload(client, key)
            # The engine waits for the device to free it (DESIGN.md §3 rule 7) before the
            # record leaves memory; what the device still shows then did not come back.
            await wait_for(lambda k=key: gone(server, client, k), 60, f"{key}: unloaded")
            row["not_returned_bytes"] = ctx.device.used_bytes() - before
    return rows


async def gone(server: Server, client: httpx.AsyncClient, key: str) -> bool:
    rec = await server.model(client, key)
    return rec is None or rec.get("state") not in ("ready", "loading", "stopping")


async def step_memory_truth_transformers(ctx: Ctx) -> dict[str, Any]:
    return await memory_truth(ctx, "st")


async def step_memory_truth_gguf(ctx: Ctx) -> dict[str, Any]:
    return await memory_truth(ctx, "gguf")


async def step_batching_transformers(ctx: Ctx) -> dict[str, Any]:
    key = "demo-st" if ctx.dry else "0.5b-st"
    streams = [1, 2] if ctx.dry else [1, 8, 32]
    tokens = 4 if ctx.dry else 64
    config = {**ctx.base_config(),
              "models": [model_entry(ctx, key, max_batch_size=max(streams))]}
    out = ctx.partial
    out.update({"model": key, "max_tokens": tokens})
    async with Server(ctx.work, "batching", config) as server, httpx.AsyncClient() as client:
        await server.load(client, key)
        await drive(server.url, key, 2, 2, 4)  # warm-up
        for n in streams:
            count = n if ctx.dry else n * 2
            out[f"streams_{n}"] = (await drive(server.url, key, n, count, tokens)).summary()
        out["record"] = await server.model(client, key)
    one = out["streams_1"]["tokens_per_s"] or 0
    top = out[f"streams_{streams[-1]}"]["tokens_per_s"] or 0
    out["speedup_top_over_1"] = round(top / one, 2) if one else None
    return out


async def step_gpu_tests(ctx: Ctx) -> dict[str, Any]:
    cache = ctx.work / "cache"
    (cache / "models").mkdir(parents=True, exist_ok=True)
    demo = cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not demo.exists():
        demo.symlink_to(ctx.models["demo-gguf"])
    if ctx.binary is not None:  # what `make llama-server` leaves: the binary modelyard uses
        (cache / "llama-server-11434.0.0.selected").write_text(f"{ctx.binary}\n")
    env = {**os.environ, "MODELYARD_CACHE": str(cache), "MODELYARD_STANDIN_MODELS": "1",
           "MODELYARD_DEMO_SAFETENSORS": str(ctx.models["demo-st"]),
           "MODELYARD_CUDA_LLAMA_SERVER": str(ctx.binary or ""), "PYTHONUNBUFFERED": "1"}
    report = ctx.args.out / "gpu-tests.xml"
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=",
            "-W", "default", "-q", "-rs", "--timeout", "240", f"--junitxml={report}"]
    argv += ["-m", "gpu or e2e", "tests/gpu", "tests/e2e/test_offload_argv.py",
             "tests/e2e/test_transformers.py", "-k", "not structured"]
    if ctx.dry:  # here the same tests are collected (their imports checked), none run
        argv.append("--collect-only")
    log = ctx.args.out / "gpu-tests.log"  # written as it runs: kept when time runs out
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(*argv, cwd=ROOT, env=env, stdout=sink,
                                                    stderr=asyncio.subprocess.STDOUT,
                                                    start_new_session=True)
    ctx.partial["log"] = str(log)
    try:
        await proc.wait()
    finally:  # out of time: the tests and every server they started go too
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    tail = log.read_text(errors="replace").strip().splitlines()[-25:]
    ctx.partial.update(returncode=proc.returncode, tail=tail)
    if proc.returncode != 0:
        raise RuntimeError(f"pytest exited {proc.returncode}: {tail[-1] if tail else ''}")
    return ctx.partial


async def step_doctor(ctx: Ctx) -> dict[str, Any]:
    """`modelyard doctor --local --json` with the check's llama-server: the driver, NVML's
    per-process accounting, what each backend build can open, as a user would see them."""
    config = ctx.work / "doctor.yaml"
    config.write_text(yaml.safe_dump({"home": str(ctx.work / "home-doctor"),
                                      **({"llama_server_path": str(ctx.binary)}
                                         if ctx.binary else {})}))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "modelyard", "doctor", "--local", "--json", "--config",
        str(config), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    try:
        report = json.loads(out)
    except ValueError:
        return {"returncode": proc.returncode, "stdout": out.decode()[-2000:],
                "stderr": err.decode()[-2000:]}
    return {"returncode": proc.returncode, "report": report}


async def step_throughput_llamacpp(ctx: Ctx) -> dict[str, Any]:
    key = "demo-gguf" if ctx.dry else "0.5b-gguf"
    levels = [1, 2] if ctx.dry else [1, 8, 64]
    per_level = {1: 4, 2: 4} if ctx.dry else {1: 16, 8: 64, 64: 256}
    tokens = 4 if ctx.dry else 32
    config = {**ctx.base_config(), "models": [model_entry(ctx, key)]}
    out = ctx.partial
    out.update({"model": key, "max_tokens": tokens})
    async with Server(ctx.work, "throughput", config) as server, \
            httpx.AsyncClient() as client:
        await server.load(client, key)
        rec = await server.model(client, key) or {}
        argv = psutil.Process(int(rec["pid"])).cmdline()
        out["argv"] = argv
        # The same command line on another port, straight to llama-server (no key: a direct
        # client of a llama-server has none).
        direct_port = free_port()
        direct_argv = swap_port(strip_key(argv), direct_port)
        env = dict(os.environ)
        direct = Proc(direct_argv, ctx.work / "direct-llama.log", env).start()
        direct_url = f"http://{HOST}:{direct_port}"
        try:
            await wait_for(lambda: get_ok(f"{direct_url}/health"), 300, "direct llama-server",
                           direct)
            for url in (direct_url, server.url):
                await drive(url, key, 2, 2, 4)  # warm-up
            for c in levels:
                row = {}
                for target, url in (("direct", direct_url), ("modelyard", server.url)):
                    row[target] = (await drive(url, key, c, per_level[c], tokens)).summary()
                d, m = row["direct"], row["modelyard"]
                if d["req_per_s"] and m["req_per_s"]:
                    row["ratio_req_per_s"] = round(m["req_per_s"] / d["req_per_s"], 3)
                if d["p50_ms"] is not None and m["p50_ms"] is not None:
                    row["added_p50_ms"] = round(m["p50_ms"] - d["p50_ms"], 2)
                out[f"c{c}"] = row
        finally:
            await asyncio.to_thread(direct.stop)
    return out


def strip_key(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--api-key-file", "--api-key"):
            skip = True
            continue
        out.append(a)
    return out


def swap_port(argv: list[str], port: int) -> list[str]:
    out = list(argv)
    out[out.index("--port") + 1] = str(port)
    if "--slot-save-path" in out:  # its own slot dir: never share one with modelyard's child
        out[out.index("--slot-save-path") + 1] = tempfile_dir()
    return out


def tempfile_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="gpu-check-slots-")


class Holder:
    """A process holding device memory (torch on the GPU; host bytes in a dry run; a claim file
    on a simulated GPU)."""

    CODE = ("import sys, torch\n"
            "x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda')\n"
            "torch.cuda.synchronize(); print('ready', flush=True); sys.stdin.read()\n")

    def __init__(self, nbytes: int) -> None:
        self.popen = subprocess.Popen([sys.executable, "-c", self.CODE, str(nbytes)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline()
        if b"ready" not in line:
            raise RuntimeError("the memory holder did not start")

    def close(self) -> None:
        if self.popen.stdin:
            self.popen.stdin.close()
        self.popen.wait(30)


async def step_scheduling(ctx: Ctx) -> dict[str, Any]:
    """Fill a GPU with ~24 GiB left, ask for one more model, then for one that cannot fit."""
    out = ctx.partial
    out.update({})
    holder = None
    if ctx.dry:
        # A simulated 4 GiB GPU: stand-ins of the demo's shape fill it (each ~0.3 GiB F16).
        base = {**ctx.base_config(), "devices": "auto", "simulate_gpus": "1x1GiB"}
        copies, big = 4, None
    else:
        free = ctx.device.free_bytes()
        keep = 24 * GIB
        holder = await asyncio.to_thread(Holder, max(0, free - keep))
        out["held_bytes"] = free - keep
        base = ctx.base_config()
        copies = 4  # ~6 GiB each: three fit in 24 GiB, the fourth evicts
        big = "8b-gguf"
    src = ctx.models["demo-gguf" if ctx.dry else "3b-gguf"]
    entries = []
    for i in range(copies):
        link = ctx.work / "models" / f"copy{i}-{src.name}"
        if not link.exists():
            os.link(src, link)
        entries.append({"id": f"copy{i}", "backend": "llamacpp", "path": str(link)})
    if big is not None:
        path = await asyncio.to_thread(standins.make, ctx.args.kit, ctx.work / "models", "8b",
                                       "gguf")
        # Hold more so the 8 B (~15 GiB) cannot fit even with every idle model evicted.
        entries.append({"id": "big", "backend": "llamacpp", "path": str(path),
                        "offload": "auto"})
    try:
        async with Server(ctx.work, "scheduling", {**base, "models": entries}) as server, \
                httpx.AsyncClient() as client:
            events = []
            for e in entries[:copies]:
                t0 = time.perf_counter()
                r = await client.post(f"{server.url}/v1/chat/completions",
                                      json=chat_body(e["id"], 4), timeout=600)
                loaded = [m["model"] for m in records(await server.status(client))
                          if m.get("state") == "ready"]
                events.append({"asked": e["id"], "status": r.status_code,
                               "seconds": round(time.perf_counter() - t0, 2),
                               "loaded_after": loaded,
                               "device_free_bytes": ctx.device.free_bytes()})
            out["fill"] = events
            out["evicted_for_last"] = [e["id"] for e in entries[:copies - 1]
                                       if e["id"] not in events[-1]["loaded_after"]]
            out["all_answered"] = all(e["status"] == 200 for e in events)
            if big is not None:
                # Room for the helper's 12 GiB more: the copies go (they are idle), then 12 GiB
                # is all there is, and the 8 B (~19 GiB with its KV) must offload.
                for e in entries[:copies]:
                    await server.unload(client, e["id"])
                extra = await asyncio.to_thread(Holder, 12 * GIB)
                try:
                    r = await client.post(f"{server.url}/v1/chat/completions",
                                          json=chat_body("big", 4), timeout=600)
                    rec = await server.model(client, "big") or {}
                    out["offload"] = {"status": r.status_code, "placement": rec.get("placement"),
                                      "memory": rec.get("memory"),
                                      "device_free_bytes": ctx.device.free_bytes(),
                                      "body": r.text[:300] if r.status_code != 200 else None}
                finally:
                    extra.close()
            logs = (ctx.work / "scheduling.log").read_text(errors="replace")
            out["out_of_memory_in_logs"] = ("out of memory" in logs.lower()
                                            or "cudaMalloc failed" in logs)
    finally:
        if holder is not None:
            holder.close()
    return out


async def step_swap(ctx: Ctx) -> dict[str, Any]:
    """Two models that cannot be loaded together (max_loaded_models 1): each request evicts the
    other. Cold: no warm tier, no read-ahead; warm: both on."""
    a, b = ("demo-gguf", "demo-st") if ctx.dry else ("3b-gguf", "3b-st")
    out = ctx.partial
    out.update({})
    for arm, extra in (("cold", {"warm_tier_bytes": 0, "gguf_read_ahead": False}),
                       ("warm", {"warm_tier_bytes": 32 * GIB, "gguf_read_ahead": True})):
        config = {**ctx.base_config(), **extra, "max_loaded_models": 1,
                  "models": [model_entry(ctx, a), model_entry(ctx, b)]}
        times: dict[str, list[float]] = {a: [], b: []}
        async with Server(ctx.work, f"swap-{arm}", config) as server:
            for _ in range(2):
                for key in (a, b):
                    times[key].append(round(await first_token_s(server.url, key), 3))
        # The first round loads from nothing: the swaps are the later ones.
        out[arm] = {k: {"first_token_s": v, "median_swap_s": statistics.median(v[1:])}
                    for k, v in times.items()}
    for key in (a, b):
        cold, warm = out["cold"][key]["median_swap_s"], out["warm"][key]["median_swap_s"]
        out[f"{key}_warm_over_cold"] = round(warm / cold, 3) if cold else None
    return out


# --------------------------------------------------------------------------------------------
# The runner.


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[Ctx], Awaitable[dict[str, Any]]]
    budget_s: float
    needs_binary: bool = False


STEPS = [
    Step("standins", step_standins, 90),
    Step("memory_truth_transformers", step_memory_truth_transformers, 60),
    Step("batching_transformers", step_batching_transformers, 60),
    # The first step that needs llama-server waits for the background build out of its budget.
    Step("memory_truth_gguf", step_memory_truth_gguf, 240, needs_binary=True),
    Step("doctor", step_doctor, 45),
    Step("gpu_tests", step_gpu_tests, 180, needs_binary=True),
    Step("scheduling", step_scheduling, 90, needs_binary=True),
    Step("throughput_llamacpp", step_throughput_llamacpp, 60, needs_binary=True),
    Step("swap", step_swap, 120, needs_binary=True),
]


def find_binary(ctx: Ctx) -> Path | None:
    """The CUDA llama-server when the background build has ended (or the one given)."""
    if ctx.args.binary is not None:
        return Path(ctx.args.binary)
    done = ctx.args.build_dir / "rc"
    if done.exists() and done.read_text().strip() == "0":
        built = ctx.args.build_dir / "bin" / "llama-server"
        return built if built.exists() else None
    return None


def build_state(ctx: Ctx) -> str:
    if ctx.args.binary is not None:
        return "given"
    rc = ctx.args.build_dir / "rc"
    return f"ended rc={rc.read_text().strip()}" if rc.exists() else "running"


def write(out: Path, results: dict[str, Any]) -> None:
    (out / "gpu-check.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "gpu-check.md").write_text(render(results))


def render(results: dict[str, Any]) -> str:
    lines = [f"# GPU check {results['started']}", "",
             f"device: {results['device']}  ", f"dry run: {results['dry_run']}  ",
             f"llama-server: {results.get('binary')} ({results.get('build')})  ",
             f"requirements unmet: {results.get('requirements_unmet') or 'none'}", "",
             "| step | status | seconds | budget |", "|---|---|---|---|"]
    for name, r in results["steps"].items():
        lines.append(f"| {name} | {r['status']} | {r.get('seconds', '')} | {r['budget_s']} |")
    for name, r in results["steps"].items():
        if r.get("error"):
            lines += ["", f"## {name}: error", "", "```", str(r["error"])[-1500:], "```"]
    return "\n".join(lines) + "\n"


def unmet_requirements() -> list[str]:
    """modelyard's (and its dependencies') requirements this Python does not meet: on the GPU
    machine, where the image's packages stand in for the project's pins."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    out: list[str] = []
    seen: set[str] = set()
    todo = ["fastapi", "uvicorn", "pydantic", "pydantic-settings", "httpx", "aiohttp", "typer",
            "rich", "gguf", "sqlalchemy", "huggingface-hub", "transformers", "accelerate",
            "mcp", "prometheus-client", "starlette"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            out.append(f"{name}: not installed")
            continue
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                version = md.version(req.name)
            except md.PackageNotFoundError:
                out.append(f"{name} needs {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(version, prereleases=True):
                out.append(f"{name} needs {req}: {version} installed")
            todo.append(req.name)
    return sorted(set(out))


async def run(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    ctx = Ctx(args, Device(args.dry_run), args.work)
    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "dry_run": args.dry_run,
        "device": ctx.device.describe(), "host": {"cpus": os.cpu_count(),
                                                  "python": platform.python_version()},
        "requirements_unmet": unmet_requirements(),
        "steps": {s.name: {"status": "not_run", "budget_s": s.budget_s} for s in STEPS}}
    write(args.out, results)
    only = set(args.only.split(",")) | {"standins"} if args.only else None
    for step in STEPS:
        left = args.deadline_s - (time.monotonic() - start)
        entry = results["steps"][step.name]
        if only is not None and step.name not in only:
            entry["why"] = "not selected (--only)"
            continue
        if left < min(step.budget_s, 30):
            entry["status"] = "not_run"
            entry["why"] = f"{left:.0f} s left"
            continue
        budget = min(step.budget_s, left)
        t0 = time.monotonic()
        if step.needs_binary and ctx.binary is None:
            # Wait for the background build, out of this step's budget.
            while (found := find_binary(ctx)) is None and build_state(ctx) == "running" \
                    and time.monotonic() - t0 < budget - 20:
                await asyncio.sleep(1)
            ctx.binary = found
            results["binary"], results["build"] = str(found), build_state(ctx)
            if found is None:
                entry.update(status="skipped", why=f"no CUDA llama-server ({build_state(ctx)})")
                write(args.out, results)
                continue
        print(f"[{time.monotonic() - start:6.1f} s] {step.name} (budget {budget:.0f} s)",
              flush=True)
        ctx.partial = {}
        try:
            entry["result"] = await asyncio.wait_for(step.run(ctx),
                                                     budget - (time.monotonic() - t0))
            entry["status"] = "ok"
        except TimeoutError:
            entry["status"] = "timeout"
            entry["result"] = ctx.partial
        except Exception as exc:
            entry["status"] = "failed"
            entry["result"] = ctx.partial
            entry["error"] = "".join(traceback.format_exception(exc))[-3000:]
        entry["seconds"] = round(time.monotonic() - t0, 1)
        print(f"[{time.monotonic() - start:6.1f} s] {step.name}: {entry['status']}", flush=True)
        write(args.out, results)
    ran = [r for r in results["steps"].values() if "not selected" not in r.get("why", "")]
    return 0 if all(r["status"] in ("ok", "skipped") for r in ran) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kit", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--binary", type=Path, help="a llama-server to use (else --build-dir's)")
    ap.add_argument("--build-dir", type=Path, default=Path("/tmp/gpu-check-build"),
                    help="where the background build puts bin/llama-server and rc")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--deadline-s", type=float, default=500.0)
    ap.add_argument("--only", help="comma-separated steps to run (standins always runs)")
    args = ap.parse_args(argv)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
