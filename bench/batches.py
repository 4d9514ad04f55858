"""What the batch API saves: model loads and wall time for a mixed JSONL over three models sent
through /v1/batches, against the same requests sent one by one in the file's order.

    make bench-batches                     # about a minute on 2 CPU cores
    .venv/bin/python bench/batches.py --requests 30 --load-time-s 0.2

One `modelyard serve` on a simulated 8 GiB GPU serves three fake models of 3 GiB each
(tests/fakes/fake_backend.py, a real process speaking llama-server's protocol; each load takes
`--load-time-s`, each token 1/`--tokens-per-s`): two fit, three do not. The file lists the
models interleaved (a, b, c, a, b, c …), the worst order for a client that sends it line by
line: with two slots and three models every request evicts the model the next one needs.

* **one by one**: the baseline, a naive client posting each line to /v1/chat/completions in the
  file's order and waiting for its answer before the next.
* **batch API**: the file uploaded to /v1/files, a batch created on it, polled until completed.
  The runner groups lines by model (the loaded ones first) and keeps `batch_max_concurrency`
  (default 2) lines in flight, so its wall time gains from both fewer loads and that overlap.

Both runs start from the same state (every model unloaded) on the same front, in turn, so load
drift hits both. Loads are counted from the fakes' start logs (one line per process start).
Results are printed as a markdown table and written to bench/results/batches-<stamp>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.proxy import Proc, free_port, stop_all, wait_healthy_sync

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
FAKE_BACKEND = ROOT / "tests" / "fakes" / "fake_backend.py"
GIB = 2**30
GPU = "1x8GiB"
MODELS = ("bench-a", "bench-b", "bench-c")
MODEL_BYTES = 3 * GIB  # two of the three fit the 8 GiB device
MESSAGES = [{"role": "user", "content": "Summarise this ticket"}]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--requests", type=int, default=36, help="lines in the JSONL (N)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens asked per request")
    p.add_argument("--load-time-s", type=float, default=0.5, help="seconds one load takes")
    p.add_argument("--tokens-per-s", type=float, default=200.0, help="fake decoding speed")
    p.add_argument("--timeout-s", type=float, default=300.0, help="give up on the batch after")
    p.add_argument("--keep-workdir", action="store_true", help="keep the temp dir with the logs")
    args = p.parse_args(argv)
    args.requests = max(3, min(args.requests, 1000))  # bounded: the run stays minutes long
    return args


def model_entry(model_id: str, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, str(FAKE_BACKEND), "--host", "$host", "--port", "$port",
            "--alias", "$id", "--claim-bytes", str(MODEL_BYTES),
            "--load-time-s", str(args.load_time_s), "--tokens-per-s", str(args.tokens_per_s),
            "--start-log", str(workdir / f"{model_id}.starts")]
    return {"id": model_id, "backend": "openai", "argv": argv, "vram_bytes": MODEL_BYTES}


def loads(workdir: Path) -> int:
    """Process starts of every fake so far (each start is one load)."""
    return sum(len(p.read_text().splitlines()) for p in workdir.glob("*.starts"))


def lines(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": MODELS[i % len(MODELS)], "messages": MESSAGES,
                      "max_tokens": args.max_tokens}}
            for i in range(args.requests)]


def unload_all(client: httpx.Client, url: str, admin: dict[str, str]) -> None:
    """Both runs start with nothing loaded: the same first loads for each."""
    for model in MODELS:
        r = client.post(f"{url}/admin/models/{model}/unload", headers=admin, timeout=60)
        if r.status_code not in (200, 204, 404, 409):
            raise RuntimeError(f"unload {model}: HTTP {r.status_code} {r.text}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        body = client.get(url + "/status", headers=admin, timeout=10).json()
        if not any(m.get("state") in ("ready", "loading") for e in body.get("engines") or ()
                   for m in e.get("models") or ()):
            return
        time.sleep(0.1)
    raise TimeoutError("models still loaded after unload")


def one_by_one(client: httpx.Client, url: str, items: list[dict[str, Any]]) -> None:
    for x in items:
        r = client.post(url + x["url"], json=x["body"], timeout=120)
        if r.status_code != 200:
            raise RuntimeError(f"one by one {x['custom_id']}: HTTP {r.status_code} {r.text}")


def batch_api(client: httpx.Client, url: str, items: list[dict[str, Any]],
              timeout_s: float) -> dict[str, Any]:
    data = b"".join(json.dumps(x).encode() + b"\n" for x in items)
    up = client.post(url + "/v1/files", files={"file": ("bench.jsonl", data)},
                     data={"purpose": "batch"}, timeout=60)
    if up.status_code != 200:
        raise RuntimeError(f"upload: HTTP {up.status_code} {up.text}")
    r = client.post(url + "/v1/batches", timeout=60, json={
        "input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    if r.status_code != 200:
        raise RuntimeError(f"create batch: HTTP {r.status_code} {r.text}")
    batch_id = r.json()["id"]
    deadline = time.monotonic() + timeout_s
    while True:
        batch = dict(client.get(f"{url}/v1/batches/{batch_id}", timeout=10).json())
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch not done after {timeout_s:.0f} s: {batch}")
        time.sleep(0.05)
    counts = batch["request_counts"]
    if batch["status"] != "completed" or counts["completed"] != len(items):
        raise RuntimeError(f"batch ended {batch['status']} with {counts}")
    return batch


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    home = workdir / "home"
    home.mkdir()
    config = {"scan_hf_cache": False, "devices": "cpu", "simulate_gpus": GPU,
              "models": [model_entry(m, workdir, args) for m in MODELS]}
    (home / "config.yaml").write_text(yaml.safe_dump(config))
    port = free_port()
    env = {**os.environ, "MODELYARD_HOME": str(home), "PYTHONUNBUFFERED": "1",
           "MODELYARD_EMBEDDING_DEMO": "false"}
    env.pop("MODELYARD_CONFIG", None)
    proc = Proc("front", [sys.executable, "-m", "modelyard", "serve", "--port", str(port),
                          "--config", str(home / "config.yaml"), "--single-process"],
                workdir / "front.log", env)
    url = f"http://127.0.0.1:{port}"
    items = lines(args)
    results: dict[str, Any] = {}
    try:
        with httpx.Client() as client:
            wait_healthy_sync(client, proc, url, 120)
            admin = {"Authorization": f"Bearer {(home / 'cli-token').read_text().strip()}"}
            for name in ("one by one", "batch API"):
                unload_all(client, url, admin)
                before = loads(workdir)
                started = time.perf_counter()
                if name == "one by one":
                    one_by_one(client, url, items)
                else:
                    batch_api(client, url, items, args.timeout_s)
                wall_s = time.perf_counter() - started
                results[name] = {"loads": loads(workdir) - before, "wall_s": wall_s}
                print(f"{name}: {results[name]['loads']} loads in {wall_s:.1f} s", flush=True)
    finally:
        stop_all()
    return results


def report(args: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    base = results["one by one"]
    rows = []
    for name, r in results.items():
        rows.append({"way": name, "requests": args.requests, "loads": r["loads"],
                     "wall_s": r["wall_s"],
                     "loads_ratio": r["loads"] / base["loads"] if base["loads"] else None,
                     "wall_ratio": r["wall_s"] / base["wall_s"] if base["wall_s"] else None})
    print(f"\n## {args.requests} requests over {len(MODELS)} models, interleaved; two fit "
          f"({args.load_time_s:g} s per load, {args.max_tokens} tokens at "
          f"{args.tokens_per_s:g} tokens/s)\n")
    print("| way | requests | loads | wall (s) | loads vs one by one | wall vs one by one |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['way']} | {r['requests']} | {r['loads']} | {r['wall_s']:.1f} | "
              f"{r['loads_ratio']:.2f}x | {r['wall_ratio']:.2f}x |")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="modelyard-bench-batches-"))
    try:
        results = run(args, workdir)
    except Exception as exc:
        print(f"bench-batches failed: {exc}\n(logs in {workdir})", file=sys.stderr)
        return 1
    rows = report(args, results)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"batches-{stamp}.json"
    path.write_text(json.dumps({"args": vars(args), "host": platform.node(), "rows": rows},
                               indent=1, default=str))
    print(f"\nresults: {path}")
    if not args.keep_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
