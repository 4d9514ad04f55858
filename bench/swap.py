"""What warm swaps buy: request → first token for a model evicted a moment ago, cold against
warm, through one `modelyard serve` (CPU engine), the two arms interleaved repeat by repeat.

    make bench-swap                        # about 2-3 minutes on 2 CPU cores
    .venv/bin/python bench/swap.py --repeats 1      # the smallest run

* **transformers** (the demo model as safetensors, `make demo-safetensors`): the model is
  unloaded, then asked for. Cold: `warm_tier_bytes: 0`, the load reads and converts its files.
  Warm: the default warm tier kept the converted module; the load takes it back.
  Target: warm <= 0.2x cold.
* **gguf** (the demo GGUF on llama-server): the GGUF was evicted a moment ago for the
  transformers model (`max_loaded_models: 1`, so the two always swap) and its file dropped from
  the page cache
  (`posix_fadvise(POSIX_FADV_DONTNEED)`); the request evicts the transformers model, then loads
  the GGUF. Cold: `gguf_read_ahead: false`, llama-server faults the file in from disk. Warm: the
  engine reads the file ahead while the request waits for the eviction.

The arms switch by rewriting the config and `POST /admin/reload` (both options apply at once),
so both run on the same server, same processes, same page cache otherwise. TTFT is from sending
a streamed chat to its first chunk with text. Results go to bench/results/swap-<stamp>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.proxy import (
    Inputs,
    find_binary,
    find_model,
    is_healthy,
    modelyard_home,
    spawn_modelyard,
    stop_all,
    wait_until,
)
from modelyard.config import DEMO_MODEL_ID, cache_dir

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
TARGET_TF_RATIO = 0.2
TF_MODEL = "smollm2-tf"
DEMO_SAFETENSORS = "smollm2-135m-instruct-safetensors"  # where `make demo-safetensors` puts it
MESSAGES = [{"role": "user", "content": "Name one colour of the rainbow."}]
ARMS = {  # the settings each arm runs with
    "cold": {"warm_tier_bytes": 0, "gguf_read_ahead": False},
    "warm": {"warm_tier_bytes": 4 * 2**30, "gguf_read_ahead": True},
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--repeats", type=int, default=5, help="cold+warm pairs per scenario")
    p.add_argument("--scenarios", default="transformers,gguf")
    p.add_argument("--safetensors", type=Path, default=cache_dir() / "models" / DEMO_SAFETENSORS,
                   help="the demo model as a safetensors repo (make demo-safetensors)")
    p.add_argument("--ctx-size", type=int, default=2048)
    p.add_argument("--llama-server", type=Path, help="binary (default: modelyard's resolution)")
    p.add_argument("--model", type=Path, help="GGUF (default: the cached demo model)")
    p.add_argument("--wait-binary", type=float, default=900.0)
    return p.parse_args(argv)


def drop_page_cache(path: Path) -> None:
    """Evict `path`'s pages from the page cache (clean pages no process maps: the GGUF's
    llama-server has exited), as if the host had needed the memory meanwhile."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Bench:
    def __init__(self, client: httpx.AsyncClient, url: str, home: Path, gguf: Path) -> None:
        self.client = client
        self.url = url
        self.home = home
        self.gguf_file = gguf
        self.base = yaml.safe_load((home / "config.yaml").read_text())
        self.arm: str | None = None

    async def use(self, arm: str) -> None:
        """Run with `arm`'s settings from now on (a config reload; models keep running)."""
        if arm == self.arm:
            return
        (self.home / "config.yaml").write_text(yaml.safe_dump({**self.base, **ARMS[arm]}))
        r = await self.client.post(self.url + "/admin/reload")
        if r.status_code != 200:
            raise RuntimeError(f"reload: {r.status_code} {r.text}")
        self.arm = arm

    async def ttft(self, model: str, max_tokens: int = 4) -> float:
        body = {"model": model, "messages": MESSAGES, "stream": True, "max_tokens": max_tokens,
                "temperature": 0}
        started = time.perf_counter()
        async with self.client.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{model}: {r.status_code} {(await r.aread())!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        first = time.perf_counter() - started
                        await r.aclose()
                        return first
        raise RuntimeError(f"{model}: no text streamed")

    async def unload(self, model: str) -> None:
        r = await self.client.post(self.url + "/api/generate",
                                   json={"model": model, "keep_alive": 0})
        r.raise_for_status()

    async def load_s(self, model: str) -> float:
        """How long `model`'s last load took, as its engine measured it (request → ready)."""
        r = await self.client.get(self.url + "/status")
        r.raise_for_status()
        for engine in r.json()["engines"]:
            for m in engine.get("models") or ():
                if m["model"] == model and m.get("load_duration_s") is not None:
                    return float(m["load_duration_s"])
        raise RuntimeError(f"{model}: no load time in /status")

    async def transformers(self, arm: str) -> tuple[float, float]:
        await self.use(arm)
        await self.ttft(TF_MODEL, 1)  # loaded (untimed; it evicts the GGUF)
        await self.unload(TF_MODEL)  # evicted a moment ago
        return await self.ttft(TF_MODEL), await self.load_s(TF_MODEL)

    async def gguf(self, arm: str) -> tuple[float, float]:
        # Runs after `transformers`, which evicted the GGUF for the transformers model
        # (max_loaded_models 1) a moment ago; that model is loaded.
        await self.use(arm)
        await self.ttft(TF_MODEL, 1)
        drop_page_cache(self.gguf_file)
        return await self.ttft(DEMO_MODEL_ID), await self.load_s(DEMO_MODEL_ID)


async def measure(args: argparse.Namespace, results: dict[str, Any]) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="bench-swap-"))
    inputs = Inputs(find_binary(args), find_model(args), args.ctx_size, workdir)
    home = modelyard_home(inputs, single_process=False)
    config = yaml.safe_load((home / "config.yaml").read_text())
    config |= {"auth": "none", "max_loaded_models": 1, "models": [{
        "id": TF_MODEL, "backend": "transformers", "path": str(args.safetensors),
        "max_batch_size": 2, "prefix_cache_tokens": 0, "session_cache_tokens": 0}]}
    (home / "config.yaml").write_text(yaml.safe_dump(config))
    proc, url = spawn_modelyard(inputs, home)
    scenarios = args.scenarios.split(",")
    samples: dict[str, dict[str, list[tuple[float, float]]]] = {
        s: {"cold": [], "warm": []} for s in scenarios}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await wait_until(client, url + "/health", proc, is_healthy, timeout_s=120)
        bench = Bench(client, url, home, inputs.model)
        for i in range(args.repeats):
            # Alternate which arm goes first, so drift does not favour one.
            order = ("cold", "warm") if i % 2 == 0 else ("warm", "cold")
            for name in scenarios:
                for arm in order:
                    samples[name][arm].append(await getattr(bench, name)(arm))
            print(f"  repeat {i + 1}/{args.repeats} done", flush=True)
    for name, arms in samples.items():
        row: dict[str, Any] = {"samples": arms}
        for i, figure in enumerate(("ttft", "load")):
            cold = statistics.median(s[i] for s in arms["cold"])
            warm = statistics.median(s[i] for s in arms["warm"])
            row |= {f"{figure}_cold_s": cold, f"{figure}_warm_s": warm,
                    f"{figure}_ratio": warm / cold}
        results["scenarios"][name] = row
    results["workdir"] = str(workdir)


def render(results: dict[str, Any]) -> str:
    lines = [
        "Request → first token for a model evicted a moment ago, cold vs warm (median of "
        f"{results['args']['repeats']}; target for transformers: ratio <= {TARGET_TF_RATIO})",
        "",
        "| model | TTFT cold | TTFT warm | ratio | load cold | load warm | ratio | warm is |",
        "|---|---|---|---|---|---|---|---|",
    ]
    what = {"transformers": "converted module kept in host memory (warm tier)",
            "gguf": "file read ahead into the page cache while the request waits"}
    for name, r in results["scenarios"].items():
        lines.append(
            f"| {name} | {r['ttft_cold_s'] * 1e3:.0f} ms | {r['ttft_warm_s'] * 1e3:.0f} ms "
            f"| **{r['ttft_ratio']:.2f}** | {r['load_cold_s'] * 1e3:.0f} ms "
            f"| {r['load_warm_s'] * 1e3:.0f} ms | {r['load_ratio']:.2f} | {what[name]} |")
    lines += ["", "TTFT: request sent → first streamed token, through the front. Load: the "
              "engine's own load time (request → model ready, evictions included)."]
    return "\n".join(lines)


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results: dict[str, Any] = {"args": vars(args), "scenarios": {},
                               "machine": {"platform": platform.platform(),
                                           "cpus": os.cpu_count()}}
    started = time.monotonic()
    try:
        asyncio.run(measure(args, results))
    finally:
        stop_all()
    results["duration_s"] = time.monotonic() - started
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"swap-{stamp}.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    print("\n" + render(results) + f"\n\n{path} ({results['duration_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
