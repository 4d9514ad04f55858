"""What constrained decoding (llguidance, a JSON schema per sequence) costs the transformers engine.

    .venv/bin/python -m bench.constrained                # random Llama (vocab 2048), < 1 minute
    .venv/bin/python -m bench.constrained --model DIR    # e.g. the demo SmolLM2-135M safetensors
                                                         # directory (vocab 49152: the mask is
                                                         # computed over every token)

N requests submitted at once to one `BatchGenerator` (greedy), each generating exactly `--tokens`
tokens: once unconstrained (`ignore_eos`), once with a JSON schema whose array cannot close before
`--tokens` (`minItems` far above it), so that both sides generate the same number of tokens.
Aggregate tokens/s = N * tokens / wall time, median of `--repeats`, the two sides interleaved so
that load drift on a shared machine hits both. The ratio is the price of computing, applying and
advancing a matcher per sequence per token (grammar compilation included: one per request).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

import torch

from bench.batch_core import build, load, prompts
from modelyard.engine.backends.transformers.constraints import Compiler
from modelyard.engine.backends.transformers.generator import BatchGenerator
from modelyard.engine.backends.transformers.params import SamplingParams

ITEMS = {"type": "object", "additionalProperties": False, "required": ["name", "score"],
         "properties": {"name": {"type": "string", "maxLength": 12},
                        "score": {"type": "integer"}}}
SCHEMA = {"type": "array", "items": ITEMS, "minItems": 100_000}
BODY = {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}


async def run(gen: BatchGenerator, compiler: Compiler | None, batch: list[list[int]],
              tokens: int) -> float:
    async def one(ids: list[int]) -> int:
        constraint = None
        if compiler is not None:  # compiled per request, as the server does
            constraint = await asyncio.to_thread(compiler.for_request, BODY, False, None)
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        got = 0
        async for event in gen.generate(ids, params, constraint=constraint):
            got += len(event.token_ids)
        return got

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(ids) for ids in batch))
    wall = time.perf_counter() - start
    assert counts == [tokens] * len(batch), counts
    return wall


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a local Hugging Face model directory instead of the "
                    "random Llama")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model: Any
    if args.model:
        model, tokenizer = load(args.model)
        what = args.model
    else:
        model, tokenizer = build(args.vocab, 256, 4, args.seed)
        what = "random Llama, hidden 256, 4 layers"
    gen = BatchGenerator(model, tokenizer, max_batch_size=max(args.concurrency),
                         prefix_cache_tokens=0)
    gen.start()
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [0]
    compiler = Compiler(tokenizer, eos, model.config.vocab_size)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs;"
          f" {what}, vocab {len(tokenizer)}; {args.tokens} tokens per request, greedy, median "
          f"of {args.repeats}")
    print("\n| concurrent | unconstrained tok/s | JSON schema tok/s | schema / unconstrained |")
    print("|---|---|---|---|")
    try:
        warm = prompts(tokenizer, 2, args.seed + 1)
        asyncio.run(run(gen, None, warm, 4))
        asyncio.run(run(gen, compiler, warm, 4))  # also wraps the tokenizer (once)
        for n in args.concurrency:
            sides: dict[bool, list[float]] = {False: [], True: []}
            for r in range(args.repeats):
                batch = prompts(tokenizer, n, args.seed + 100 * n + r)
                for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                    wall = asyncio.run(run(gen, compiler if constrained else None, batch,
                                           args.tokens))
                    sides[constrained].append(n * args.tokens / wall)
            free, held = statistics.median(sides[False]), statistics.median(sides[True])
            print(f"| {n} | {free:.0f} | {held:.0f} | {held / free:.2f}x |", flush=True)
    finally:
        gen.stop()


if __name__ == "__main__":
    sys.exit(main())
