"""What a chat session buys an agent: time to first token of turn N with a server-side session
(`session_id`: the history and its KV stay in modelyard) against the same conversation resent
whole without one, same model, same modelyard, same run, the two interleaved turn by turn.

    make bench-session                     # about 5 minutes on 2 CPU cores
    .venv/bin/python bench/session.py --quick

Both arms run the demo model through one `modelyard serve` (its own llama-server command line:
4 fixed slots, `--slot-save-path`). Every turn adds a user message of `--words` words and asks for
`--answer-tokens` tokens at temperature 0, streamed; TTFT is from sending the request to the first
streamed chunk with text. Two scenarios:

* **interleaved**: `--agents` session agents and as many stateless twins take turns round-robin,
  so twice as many conversations as slots pass through the backend. (llama-server's own host-RAM
  prompt cache, `--cache-ram`, already keeps stateless conversations too: expect little gain.)
* **swapped**: the model is unloaded and loaded again before every turn (untimed), as when other
  models take the device between an agent's turns. llama-server's caches die with the process;
  the session's KV, saved to disk after each turn, is restored into its slot.
* **transformers**: the interleaved agents on the same model run by the in-process transformers
  engine (the demo model as safetensors), whose shared prefix cache (4096 tokens) holds less
  than all the conversations; a session's KV is pinned apart from it (`session_cache_tokens`).

Reported per scenario: the median TTFT of the last turn in each arm, their ratio (target <= 0.3)
and the prompt tokens the backend reused. Results go to bench/results/session-<stamp>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
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
TARGET_RATIO = 0.3
TF_MODEL = "smollm2-tf"
DEMO_SAFETENSORS = "smollm2-135m-instruct-safetensors"  # where `make demo-safetensors` puts it
WORDS = [
    "river", "stone", "cloud", "lantern", "orchard", "meadow", "harbor", "engine", "signal",
    "quartz", "violet", "maple", "thunder", "copper", "falcon", "glacier", "saddle", "ember",
    "compass", "willow",
]


FULL = {"turns": 10, "agents": 4, "swap_agents": 2, "words": 100}
QUICK = {"turns": 5, "agents": 2, "swap_agents": 1, "words": 60}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    # Defaults in QUICK/FULL below: --quick must not override what is given explicitly.
    p.add_argument("--turns", type=int, help="turns per conversation (default 10)")
    p.add_argument("--agents", type=int, help="session agents (interleaved; default 4)")
    p.add_argument("--swap-agents", type=int, help="session agents (swapped; default 2)")
    p.add_argument("--words", type=int, help="words per user message (default 100)")
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--ctx-size", type=int, default=4096, help="per slot")
    p.add_argument("--scenarios", default="interleaved,swapped,transformers")
    p.add_argument("--safetensors", type=Path, default=cache_dir() / "models" / DEMO_SAFETENSORS,
                   help="the demo model as a safetensors repo (make demo-safetensors)")
    p.add_argument("--tf-prefix-cache-tokens", type=int, default=4096,
                   help="the shared prefix cache: less than the agents' conversations")
    p.add_argument("--tf-session-cache-tokens", type=int, default=8192)
    p.add_argument("--quick", action="store_true", help="5 turns, 2+1 agents, 60 words")
    p.add_argument("--llama-server", type=Path, help="binary (default: modelyard's resolution)")
    p.add_argument("--model", type=Path, help="GGUF (default: the cached demo model)")
    p.add_argument("--wait-binary", type=float, default=900.0)
    args = p.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


@dataclass
class Agent:
    """One conversation; `session` None: the client keeps the history and resends it."""

    name: str
    session: str | None
    seed: int
    history: list[dict[str, Any]] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)

    def user_message(self, turn: int, words: int) -> dict[str, Any]:
        rng = random.Random(self.seed * 1000 + turn)
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        return {"role": "user", "content": f"Turn {turn}. Summarise: {text}"}


async def turn(client: httpx.AsyncClient, url: str, model: str, agent: Agent, n: int,
               args: argparse.Namespace) -> None:
    message = agent.user_message(n, args.words)
    body: dict[str, Any] = {
        "model": model, "stream": True, "temperature": 0,
        "max_tokens": args.answer_tokens, "stream_options": {"include_usage": True},
    }
    if agent.session is not None:
        body |= {"session_id": agent.session, "messages": [message]}
    else:
        body["messages"] = [*agent.history, message]
    text, usage, first = [], None, None
    started = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{agent.name} turn {n}: {r.status_code} {await r.aread()!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
            usage = chunk.get("usage") or usage
    agent.ttft_s.append((first or time.perf_counter()) - started)
    agent.cached.append(int(((usage or {}).get("prompt_tokens_details") or {})
                            .get("cached_tokens") or 0))
    agent.prompt.append(int((usage or {}).get("prompt_tokens") or 0))
    agent.history += [message, {"role": "assistant", "content": "".join(text)}]


async def swap(client: httpx.AsyncClient, url: str) -> None:
    """Unload the model and load it again (what another model taking the device does)."""
    for body in ({"model": DEMO_MODEL_ID, "keep_alive": 0}, {"model": DEMO_MODEL_ID}):
        r = await client.post(url + "/api/generate", json=body)
        r.raise_for_status()


async def scenario(client: httpx.AsyncClient, url: str, name: str, agents: int,
                   args: argparse.Namespace) -> dict[str, Any]:
    model = TF_MODEL if name == "transformers" else DEMO_MODEL_ID
    # Each conversation has its own messages (same lengths): a twin sharing its partner's
    # would find the partner's prompt, computed a moment before, in the backend's cache.
    pairs = [(Agent(f"{name}-s{i}", f"{name}-{i}-{time.time_ns()}", 2 * i),
              Agent(f"{name}-r{i}", None, 2 * i + 1)) for i in range(agents)]
    for n in range(1, args.turns + 1):
        for with_session, resent in pairs:
            # Alternate which arm goes first so neither always follows the other.
            order = (with_session, resent) if n % 2 else (resent, with_session)
            for agent in order:
                if name == "swapped":
                    await swap(client, url)
                await turn(client, url, model, agent, n, args)
        print(f"  {name}: turn {n}/{args.turns} done", flush=True)
    last = args.turns - 1
    s_ttft = statistics.median(s.ttft_s[last] for s, _ in pairs)
    r_ttft = statistics.median(r.ttft_s[last] for _, r in pairs)
    return {
        "model": model,
        "agents": agents,
        "turn": args.turns,
        "ttft_session_s": s_ttft,
        "ttft_resent_s": r_ttft,
        "ratio": s_ttft / r_ttft if r_ttft else None,
        "prompt_tokens": statistics.median(s.prompt[last] for s, _ in pairs),
        "cached_session": statistics.median(s.cached[last] for s, _ in pairs),
        "cached_resent": statistics.median(r.cached[last] for _, r in pairs),
        "per_turn_ttft_session_s": [statistics.median(s.ttft_s[t] for s, _ in pairs)
                                    for t in range(args.turns)],
        "per_turn_ttft_resent_s": [statistics.median(r.ttft_s[t] for _, r in pairs)
                                   for t in range(args.turns)],
    }


async def measure(args: argparse.Namespace, results: dict[str, Any]) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="bench-session-"))
    inputs = Inputs(find_binary(args), find_model(args), args.ctx_size, workdir)
    home = modelyard_home(inputs, single_process=False)
    if "transformers" in args.scenarios.split(","):
        config = yaml.safe_load((home / "config.yaml").read_text())
        config["models"] = [*config.get("models", []), {
            "id": TF_MODEL, "backend": "transformers", "path": str(args.safetensors),
            "max_batch_size": 2, "prefix_cache_tokens": args.tf_prefix_cache_tokens,
            "session_cache_tokens": args.tf_session_cache_tokens}]
        (home / "config.yaml").write_text(yaml.safe_dump(config))
    proc, url = spawn_modelyard(inputs, home)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await wait_until(client, url + "/health", proc, is_healthy, timeout_s=120)
        await client.post(url + "/api/generate", json={"model": DEMO_MODEL_ID})  # load
        for name in args.scenarios.split(","):
            agents = args.swap_agents if name == "swapped" else args.agents
            print(f"{name}: {agents} agents with a session, {agents} resending, "
                  f"{args.turns} turns", flush=True)
            results["scenarios"][name] = await scenario(client, url, name, agents, args)
    results["workdir"] = str(workdir)


def render(results: dict[str, Any]) -> str:
    lines = [
        f"Turn-{results['args']['turns']} time to first token, session vs resending the whole "
        f"history (demo model through modelyard; target ratio <= {TARGET_RATIO})",
        "",
        "| scenario | agents/arm | prompt tokens | cached: session | cached: resent "
        "| TTFT session | TTFT resent | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["scenarios"].items():
        lines.append(
            f"| {name} | {r['agents']} | {r['prompt_tokens']:.0f} | {r['cached_session']:.0f} "
            f"| {r['cached_resent']:.0f} | {r['ttft_session_s'] * 1e3:.0f} ms "
            f"| {r['ttft_resent_s'] * 1e3:.0f} ms | {r['ratio']:.2f} |")
    return "\n".join(lines)


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results: dict[str, Any] = {"args": vars(args) | {"llama_server": str(args.llama_server),
                                                     "model": str(args.model)},
                               "machine": {"platform": platform.platform()}, "scenarios": {}}
    started = time.monotonic()
    try:
        asyncio.run(measure(args, results))
    finally:
        stop_all()
    results["duration_s"] = time.monotonic() - started
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"session-{stamp}.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    print("\n" + render(results) + f"\n\n{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
