"""What a cluster costs and how fast it heals: a request relayed to a remote node's engine against
the same request to a local engine, and the time from a node's removal to the next answer.

    make bench-cluster                     # about 1-2 minutes on 2 CPU cores
    .venv/bin/python bench/cluster.py --requests 50

The cluster is the cluster tier's (tests/cluster/conftest.py): a Ray head at 127.0.0.4 (the
front's node address) and nodes n2 (127.0.0.2) and n3 (127.0.0.3), each with one simulated
24 GiB GPU, Ray's token authentication on. The baseline is a plain `modelyard serve` on a
simulated GPU of the same size. Both serve the same fake backend (tests/fakes/fake_backend.py,
a real process speaking llama-server's protocol), so the difference is the relay: front → engine
and model server at another address, against front → engine on loopback. The two are driven in
turn, request by request, so load drift hits both.

Failover: the model's node is removed at once (its raylet and every process under it killed);
the time to the next successful answer is the front noticing, and the model loading on the
survivor. Results are printed as markdown tables and written to bench/results/cluster-<stamp>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
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
from bench.proxy import Proc, free_port, stop_all, wait_healthy_sync

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
FAKE_BACKEND = ROOT / "tests" / "fakes" / "fake_backend.py"
HEAD = "127.0.0.4"
NODES = {"n2": "127.0.0.2", "n3": "127.0.0.3"}
GPU = "1x24GiB"
MODEL = "m"
MESSAGES = [{"role": "user", "content": "Say hello to me"}]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--requests", type=int, default=100, help="1-token requests per target")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured requests per target")
    p.add_argument("--failover-timeout", type=float, default=60.0,
                   help="seconds to wait for an answer after the node's removal")
    p.add_argument("--keep-workdir", action="store_true", help="keep the temp dir with the logs")
    args = p.parse_args(argv)
    args.requests = max(1, min(args.requests, 2000))  # bounded: the run stays minutes long
    return args


def model_entry() -> dict[str, Any]:
    argv = [sys.executable, str(FAKE_BACKEND), "--host", "$host", "--port", "$port",
            "--alias", "$id", "--claim-bytes", str(2**30)]
    return {"id": MODEL, "backend": "openai", "argv": argv, "vram_bytes": 2**30}


def serve(workdir: Path, tag: str, config: dict[str, Any]) -> tuple[Proc, str]:
    home = workdir / tag
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.yaml").write_text(yaml.safe_dump(config))
    port = free_port()
    env = {**os.environ, "MODELYARD_HOME": str(home), "PYTHONUNBUFFERED": "1",
           "MODELYARD_EMBEDDING_DEMO": "false"}
    env.pop("MODELYARD_CONFIG", None)
    argv = [sys.executable, "-m", "modelyard", "serve", "--port", str(port),
            "--config", str(home / "config.yaml")]
    return Proc(tag, argv, workdir / f"{tag}.log", env), f"http://127.0.0.1:{port}"


def chat(client: httpx.Client, url: str) -> tuple[int, float]:
    started = time.perf_counter()
    r = client.post(url + "/v1/chat/completions", timeout=30,
                    json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1})
    return r.status_code, (time.perf_counter() - started) * 1000


def holders(client: httpx.Client, url: str, home: Path) -> set[str]:
    """The engines the front lists with the model ready."""
    token = (home / "cli-token").read_text().strip()
    body = client.get(url + "/status", headers={"Authorization": f"Bearer {token}"},
                      timeout=10).json()
    return {str(e["name"]) for e in body["engines"]
            if any(m["model"] == MODEL and m["state"] == "ready" for m in e.get("models") or ())}


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    token = workdir / "cluster-token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    # Ray reads these once per process: set before it is imported.
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)
    from ray.cluster_utils import Cluster

    from modelyard.wire.cluster import HOST_LABEL, NODE_LABEL, TOKEN_FILE_ENV

    store = 80 * 2**20
    started = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "node_ip_address": HEAD,
        "object_store_memory": store})
    try:
        nodes = {host: cluster.add_node(
            num_cpus=1, node_ip_address=ip, object_store_memory=store,
            labels={NODE_LABEL: "true", HOST_LABEL: host},
            env_vars={"MODELYARD_HOME": str(workdir / host), "MODELYARD_SIMULATE_GPUS": GPU,
                      TOKEN_FILE_ENV: str(token), "MODELYARD_EMBEDDING_DEMO": "false"})
            for host, ip in NODES.items()}
        cluster.wait_for_nodes()
        print(f"cluster up in {time.monotonic() - started:.1f} s", flush=True)
        base = {"scan_hf_cache": False, "models": [model_entry()]}
        local, local_url = serve(workdir, "local", {**base, "simulate_gpus": GPU})
        front, front_url = serve(workdir, "front", {
            **base, "node_address": HEAD,
            "cluster": {"mode": "ray", "ray_address": cluster.address,
                        "token_file": str(token)}})
        with httpx.Client() as client:
            wait_healthy_sync(client, local, local_url, 180)
            wait_healthy_sync(client, front, front_url, 180)
            for _ in range(args.warmup):  # the first one loads the model
                for url in (local_url, front_url):
                    status, _ = chat(client, url)
                    if status != 200:
                        raise RuntimeError(f"{url}: HTTP {status}")
            samples: dict[str, list[float]] = {"local": [], "cluster": []}
            for _ in range(args.requests):
                for name, url in (("local", local_url), ("cluster", front_url)):
                    status, ms = chat(client, url)
                    if status != 200:
                        raise RuntimeError(f"{name}: HTTP {status}")
                    samples[name].append(ms)
            (engine,) = holders(client, front_url, workdir / "front")
            host = engine.split("/")[0]
            removed = time.perf_counter()
            cluster.remove_node(nodes.pop(host), allow_graceful=False)
            # Done at the first answer given while the front no longer lists the removed
            # engine: the removed node's processes take a moment to die, and answers they give
            # meanwhile are not a failover.
            failed = 0
            while True:
                waited = time.perf_counter() - removed
                if waited > args.failover_timeout:
                    raise RuntimeError(f"no answer {waited:.0f} s after {host} left")
                status, _ = chat(client, front_url)
                if status == 200:
                    now = holders(client, front_url, workdir / "front")
                    if now and engine not in now:
                        break
                else:
                    failed += 1
                time.sleep(0.05)
            failover_ms = (time.perf_counter() - removed) * 1000
            survivor = ", ".join(sorted(now))
        return {"samples": samples, "failover_ms": failover_ms, "failed_before": failed,
                "removed": engine, "survivor": survivor}
    finally:
        stop_all()
        cluster.shutdown()


def report(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    local, remote = result["samples"]["local"], result["samples"]["cluster"]
    rows = []
    for label, q in (("p50", 0.5), ("p99", 0.99), ("mean", None)):
        lo = statistics.fmean(local) if q is None else pct(local, q)
        cl = statistics.fmean(remote) if q is None else pct(remote, q)
        rows.append({"stat": label, "local_ms": lo, "cluster_ms": cl, "added_ms": cl - lo,
                     "ratio": cl / lo if lo else None})
    print(f"\n## Relay to a remote node ({args.requests} 1-token requests each, interleaved)\n")
    print("| stat | local engine (ms) | remote node (ms) | added (ms) | ratio |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['stat']} | {r['local_ms']:.2f} | {r['cluster_ms']:.2f} | "
              f"{r['added_ms']:+.2f} | {r['ratio']:.2f}x |")
    print("\n## Failover\n")
    print("| engine removed | served next by | time to next answer (ms) | failed tries |")
    print("|---|---|---:|---:|")
    print(f"| {result['removed']} | {result['survivor']} | {result['failover_ms']:.0f} | "
          f"{result['failed_before']} |")
    return {"relay": rows, **{k: v for k, v in result.items() if k != "samples"},
            "samples": result["samples"]}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="modelyard-bench-cluster-"))
    try:
        result = run(args, workdir)
    except Exception as exc:
        print(f"bench-cluster failed: {exc}\n(logs in {workdir})", file=sys.stderr)
        return 1
    summary = report(args, result)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"cluster-{stamp}.json"
    path.write_text(json.dumps({"args": vars(args), "host": platform.node(), **summary},
                               indent=1, default=str))
    print(f"\nresults: {path}")
    if not args.keep_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
