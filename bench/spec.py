"""`make bench-spec`: generation speed with and without a speculative-decoding draft, same run.

Two llama-servers started exactly as the engine starts them (engine/backends/llamacpp.py argv,
one without and one with `draft_model`), the demo model drafting for itself (the mechanism: a
draft as big as its target cannot be faster, so expect a ratio near or under 1 on a CPU; a real
pair is a 0.5B draft for a 7B+ target on a GPU). Both answer the same prompts at temperature 0;
the table shows decoded tokens/s (llama-server's own `timings`), their ratio and the draft's
acceptance rate (its /metrics counters, as /status reports them).

    python bench/spec.py [--quick] [--max-tokens N] [--prompts N]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from modelyard.config import DEMO_MODEL_FILE, LlamaCppModel, Settings, cache_dir
from modelyard.engine.backends.openai_server import ChildServer
from modelyard.engine.speculative import read_draft_counts

PROMPTS = [
    "Count from 1 to 40, separated by commas.",
    "List the days of the week, one per line.",
    "Write the alphabet in capital letters, separated by spaces.",
    "Repeat the sentence 'the cat sat on the mat' five times.",
]


@dataclass(frozen=True)
class Run:
    name: str
    tokens: int
    decode_s: float
    wall_s: float
    drafted: int | None = None
    accepted: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s else 0.0

    @property
    def acceptance(self) -> float | None:
        if not self.drafted or self.accepted is None:
            return None
        return self.accepted / self.drafted


async def _measure(name: str, server: ChildServer, prompts: list[str], max_tokens: int) -> Run:
    tokens, decode_s = 0, 0.0
    started = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=300)
    # the load's key, as the engine and the front send it (llama-server runs keyed)
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else None
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        for prompt in prompts:
            body = {"messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens, "temperature": 0}
            async with session.post(f"{server.url}/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                timings = (await r.json())["timings"]
            tokens += int(timings["predicted_n"])
            decode_s += float(timings["predicted_ms"]) / 1000
    wall_s = time.perf_counter() - started
    counts = await read_draft_counts(server.url, server.api_key)
    drafted, accepted = counts if counts is not None else (None, None)
    return Run(name, tokens, decode_s, wall_s, drafted, accepted)


async def _serve(spec: LlamaCppModel, settings: Settings, prompts: list[str],
                 max_tokens: int, name: str) -> Run:
    server = ChildServer(spec, settings)
    await server.start()
    try:
        return await _measure(name, server, prompts, max_tokens)
    finally:
        await server.stop()


def table(runs: list[Run]) -> str:
    base = runs[0].tokens_per_s
    lines = ["| run | tokens | decode tok/s | ratio | wall s | drafted | accepted | acceptance |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        ratio = run.tokens_per_s / base if base else 0.0
        rate = run.acceptance
        lines.append(
            f"| {run.name} | {run.tokens} | {run.tokens_per_s:.1f} | {ratio:.2f}x | "
            f"{run.wall_s:.2f} | {'-' if run.drafted is None else run.drafted} | "
            f"{'-' if run.accepted is None else run.accepted} | "
            f"{'-' if rate is None else f'{rate:.1%}'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one prompt, 16 tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--model", type=Path, default=cache_dir() / "models" / DEMO_MODEL_FILE)
    args = parser.parse_args(argv)
    max_tokens = 16 if args.quick else args.max_tokens
    prompts = PROMPTS[: 1 if args.quick else args.prompts]
    if not args.model.is_file():
        print(f"no model at {args.model}: run `make demo-model`", file=sys.stderr)
        return 2
    home = cache_dir() / "bench-spec"
    settings = Settings(home=home, default_ctx_size=1024, llama_server_parallel=1)
    plain = LlamaCppModel(id="target", path=args.model)
    paired = LlamaCppModel(id="target+draft", path=args.model, draft_model=str(args.model))

    async def both() -> list[Run]:
        return [await _serve(plain, settings, prompts, max_tokens, "without draft"),
                await _serve(paired, settings, prompts, max_tokens, "with draft (same model)")]

    runs = asyncio.run(both())
    print(f"speculative decoding on {args.model.name}: {len(prompts)} prompts x "
          f"{max_tokens} tokens, temperature 0, one slot\n")
    print(table(runs))
    with_draft = runs[1]
    print(f"\nspeed-up with draft: {with_draft.tokens_per_s / runs[0].tokens_per_s:.2f}x, "
          f"acceptance {with_draft.acceptance or 0:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
