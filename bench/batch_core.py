"""What continuous batching, paged KV and the prefix cache buy on this machine.

    .venv/bin/python bench/batch_core.py                 # about 3 minutes on 2 CPU cores
    .venv/bin/python bench/batch_core.py --smallest      # every section, tiny sizes: < 60 s
    .venv/bin/python bench/batch_core.py --quick --hf-cb # fewer tokens; also transformers' own CB
    .venv/bin/python bench/batch_core.py --model DIR     # a local HF model instead (e.g. the demo
                                                         # SmolLM2-135M safetensors directory)

The model is a randomly initialised Llama built here (no download): hidden 256, 4 layers, 8 heads
(4 KV heads), float32, with a byte-level BPE tokenizer trained on a synthetic corpus (vocabulary
2048 by default). Every request generates exactly `--tokens` tokens (no EOS token, and
`ignore_eos` / `min_new_tokens` for a real `--model`). Each measurement is the median of
`--repeats` runs, the two sides interleaved so that load drift on a shared machine hits both.

* **throughput**: N requests (prompts of 24-56 tokens) submitted at once to one `BatchGenerator`
  (greedy), wall time from the first submission to the last token, against the same N prompts run
  one after the other through `model.generate(do_sample=False)` (the serialized baseline, measured
  in the same run). Aggregate tokens/s = N * tokens / wall time. The generator runs twice: with the
  padded KV layout (`kv_layout="padded"`, the layout before paged KV) and with paged KV.
* **KV memory, mixed lengths**: `--streams` requests at once, prompts of 16 to `--mixed-prompt`
  tokens and outputs of 8 to 2 x `--tokens` tokens (seeded), on a generator per layout: the peak
  bytes of KV storage for sequences in flight (padding, spare columns, free blocks included;
  prefix cache off), the peak tokens those sequences held (x `kv_bytes_per_token` = the floor), and
  aggregate tokens/s. Paged and padded alternate within each repeat.
* **second-turn TTFT**: turn 1 is a `--history`-token prompt plus a generated answer; turn 2 is the
  whole of turn 1 plus a new 24-token user message. TTFT of turn 2 on a generator with the prefix
  cache against one with `prefix_cache_tokens=0` (median of `--repeats`).
* **--hf-cb**: the same throughput workload through transformers' own continuous batching (a
  persistent `init_continuous_batching` manager, paged cache), for the design decision recorded
  in the package docstring.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from modelyard.engine.backends.transformers.generator import KV_LAYOUTS, BatchGenerator
from modelyard.engine.backends.transformers.params import SamplingParams


def build(vocab: int, hidden: int, layers: int, seed: int) -> tuple[Any, Any]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(3000)]
    corpus = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden,
                         intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=4096, pad_token_id=0, bos_token_id=None,
                         eos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    return model, tokenizer


def prompts(tokenizer: Any, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = len(tokenizer)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(24, 56))] for _ in range(n)]


def serialized(model: Any, batch: list[list[int]], tokens: int) -> float:
    config = GenerationConfig(do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens,
                              eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    with torch.inference_mode():
        for ids in batch:
            x = torch.tensor([ids])
            model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
    return time.perf_counter() - start


async def concurrent(gen: BatchGenerator, batch: list[list[int]], tokens: int | list[int]) -> float:
    wanted = tokens if isinstance(tokens, list) else [tokens] * len(batch)

    async def one(ids: list[int], n: int) -> int:
        got = 0
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        async for event in gen.generate(ids, params):
            got += len(event.token_ids)
        return got

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(ids, n) for ids, n in zip(batch, wanted, strict=True)))
    wall = time.perf_counter() - start
    assert counts == wanted, counts
    return wall


def mixed(tokenizer: Any, streams: int, max_prompt: int, tokens: int,
          seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts of 16 to `max_prompt` tokens, outputs of 8 to 2 x `tokens` (seeded)."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    batch = [[rng.randrange(1, vocab) for _ in range(rng.randint(16, max(16, max_prompt)))]
             for _ in range(streams)]
    return batch, [rng.randint(8, max(8, 2 * tokens)) for _ in range(streams)]


def kv_memory(model: Any, tokenizer: Any, args: argparse.Namespace) -> None:
    """Peak KV bytes and throughput of `--streams` mixed-length streams, per layout."""
    found: dict[str, dict[str, list[float]]] = {k: {"bytes": [], "held": [], "tps": []}
                                                for k in KV_LAYOUTS}
    per_token = 0
    for r in range(args.repeats):
        batch, outs = mixed(tokenizer, args.streams, args.mixed_prompt, args.tokens,
                            args.seed + 7 + r)
        for layout in (KV_LAYOUTS if r % 2 == 0 else KV_LAYOUTS[::-1]):
            gen = BatchGenerator(model, tokenizer, max_batch_size=args.streams,
                                 prefix_cache_tokens=0, kv_layout=layout)
            gen.start()
            try:
                asyncio.run(concurrent(gen, prompts(tokenizer, 2, args.seed + 1), 2))  # warm-up
                wall = asyncio.run(concurrent(gen, batch, outs))
                stats = gen.stats()
            finally:
                gen.stop()
            per_token = stats["kv_bytes_per_token"]
            found[layout]["bytes"].append(stats["kv_bytes_peak"])
            found[layout]["held"].append(stats["kv_tokens_held_peak"])
            found[layout]["tps"].append(sum(outs) / wall)
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in found.items()}
    print(f"\nKV memory, {args.streams} streams at once (prompts 16-{args.mixed_prompt} tokens, "
          f"outputs 8-{2 * args.tokens}; {per_token} KV bytes per token; median of "
          f"{args.repeats}):")
    print("\n| layout | peak KV bytes | peak tokens held | bytes / (tokens held x bytes per token)"
          " | tok/s |")
    print("|---|---|---|---|---|")
    for layout in KV_LAYOUTS:
        m = med[layout]
        floor = m["held"] * per_token
        print(f"| {layout} | {m['bytes']:,.0f} | {m['held']:.0f} | "
              f"{m['bytes'] / floor if floor else 0:.2f} | {m['tps']:.0f} |")
    paged, padded = med["paged"], med["padded"]
    print(f"\npaged / padded: KV bytes {paged['bytes'] / padded['bytes']:.3f}, throughput "
          f"{paged['tps'] / padded['tps']:.3f}", flush=True)


async def turn(gen: BatchGenerator, ids: list[int], tokens: int) -> tuple[float, list[int]]:
    start = time.perf_counter()
    ttft = 0.0
    out: list[int] = []
    async for event in gen.generate(ids, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                          ignore_eos=True)):
        if not out:
            ttft = time.perf_counter() - start
        out += event.token_ids
    return ttft, out


async def second_turn_ttft(model: Any, tokenizer: Any, cache_tokens: int, history: int,
                           repeats: int, seed: int) -> tuple[float, int]:
    gen = BatchGenerator(model, tokenizer, prefix_cache_tokens=cache_tokens)
    gen.start()
    rng = random.Random(seed)
    vocab = len(tokenizer)
    ttfts = []
    cached = 0
    try:
        await turn(gen, [1, 2, 3], 2)  # warm-up
        for _ in range(repeats):
            first = [rng.randrange(1, vocab) for _ in range(history)]
            _, answer = await turn(gen, first, 32)
            second = first + answer + [rng.randrange(1, vocab) for _ in range(24)]
            ttft, _ = await turn(gen, second, 4)
            ttfts.append(ttft)
        cached = gen.stats()["prefix_cache"]["tokens_reused"]
    finally:
        gen.stop()
    return statistics.median(ttfts), cached


def hf_cb(model: Any, batch: list[list[int]], tokens: int) -> float:
    """transformers' continuous batching: a manager started (and warmed up) beforehand, then the
    requests added at once and their results awaited (no streaming, one sampling config)."""
    from transformers.generation.configuration_utils import (
        ContinuousBatchingConfig,
    )

    config = GenerationConfig(do_sample=False, max_new_tokens=tokens, eos_token_id=-1,
                              pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=64, num_blocks=256, max_batch_tokens=1024,
                                  max_requests_per_batch=len(batch))
    manager = model.init_continuous_batching(generation_config=config,
                                             continuous_batching_config=cb)
    manager.start()

    def run(inputs: list[list[int]], n: int) -> None:
        manager.add_requests(inputs, max_new_tokens=n)
        done = 0
        while done < len(inputs):
            result = manager.get_result(timeout=30)
            if result is None:
                raise RuntimeError("transformers' CB manager returned nothing for 30 s")
            if result.is_finished():
                assert len(result.generated_tokens) == n
                done += 1

    try:
        run([batch[0][:8]], 2)  # warm-up
        start = time.perf_counter()
        run(batch, tokens)
        return time.perf_counter() - start
    finally:
        manager.stop(block=True)


def load(path: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tokenizer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--model", help="a local Hugging Face model directory instead of the "
                    "random Llama (e.g. ~/.cache/modelyard/models/smollm2-135m-instruct-"
                    "safetensors)")
    ap.add_argument("--history", type=int, default=1500, help="turn-1 prompt tokens")
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--streams", type=int, default=16, help="mixed-length streams (KV memory)")
    ap.add_argument("--mixed-prompt", type=int, default=512,
                    help="longest prompt of the mixed-length streams, tokens")
    ap.add_argument("--quick", action="store_true", help="32 tokens, 1000-token history, 1 run")
    ap.add_argument("--smallest", action="store_true",
                    help="every section at tiny sizes (hidden 64, 2 layers, 8 tokens, 1 run): "
                    "checks that the benchmark runs, in well under a minute")
    ap.add_argument("--hf-cb", action="store_true", help="also time transformers' own CB")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.history, args.repeats = 32, 1000, 1
    if args.smallest:
        args.tokens, args.history, args.repeats, args.concurrency = 8, 64, 1, [4]
        args.hidden, args.layers, args.vocab, args.mixed_prompt = 64, 2, 512, 64
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:
        model, tokenizer = load(args.model)
        what = args.model
    else:
        model, tokenizer = build(args.vocab, args.hidden, args.layers, args.seed)
        what = f"random Llama, hidden {args.hidden}, {args.layers} layers"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs;"
          f" {what}, vocab {len(tokenizer)}; {args.tokens} tokens per request, greedy, median "
          f"of {args.repeats}")
    serialized(model, prompts(tokenizer, 1, args.seed), 8)  # warm-up

    print("\n| concurrent | serialized generate tok/s | padded KV tok/s | paged KV tok/s | "
          "paged / serialized | paged / padded |" + (" transformers CB tok/s |" if args.hf_cb
                                                    else ""))
    print("|---|---|---|---|---|---|" + ("---|" if args.hf_cb else ""))
    gens = {layout: BatchGenerator(model, tokenizer, max_batch_size=max(args.concurrency),
                                   prefix_cache_tokens=0, kv_layout=layout)
            for layout in KV_LAYOUTS}
    for gen in gens.values():
        gen.start()
    try:
        for gen in gens.values():
            asyncio.run(concurrent(gen, prompts(tokenizer, 2, args.seed + 1), 4))  # warm-up
        for n in args.concurrency:
            total = n * args.tokens
            base, theirs = [], []
            ours: dict[str, list[float]] = {layout: [] for layout in KV_LAYOUTS}
            for r in range(args.repeats):  # interleaved, so load drift hits all
                batch = prompts(tokenizer, n, args.seed + 100 * n + r)
                base.append(total / serialized(model, batch, args.tokens))
                for layout in (KV_LAYOUTS if r % 2 == 0 else KV_LAYOUTS[::-1]):
                    wall = asyncio.run(concurrent(gens[layout], batch, args.tokens))
                    ours[layout].append(total / wall)
                if args.hf_cb:
                    theirs.append(total / hf_cb(model, batch, args.tokens))
            b = statistics.median(base)
            paged, padded = statistics.median(ours["paged"]), statistics.median(ours["padded"])
            row = (f"| {n} | {b:.0f} | {padded:.0f} | {paged:.0f} | {paged / b:.2f}x | "
                   f"{paged / padded:.3f} |")
            if args.hf_cb:
                row += f" {statistics.median(theirs):.0f} |"
            print(row, flush=True)
        stats = gens["paged"].stats()
    finally:
        for gen in gens.values():
            gen.stop()
    print(f"\npaged: batch size avg {stats['batch_size_avg']:.2f} over {stats['steps']} decode "
          "steps")

    kv_memory(model, tokenizer, args)

    cold, _ = asyncio.run(second_turn_ttft(model, tokenizer, 0, args.history, args.repeats,
                                           args.seed))
    warm, reused = asyncio.run(second_turn_ttft(model, tokenizer, 32768, args.history,
                                                args.repeats, args.seed))
    print(f"\nsecond-turn TTFT ({args.history}-token history + 32-token answer + 24 new tokens):"
          f"\n  without prefix cache {1e3 * cold:.1f} ms, with {1e3 * warm:.1f} ms, "
          f"ratio {warm / cold:.3f} ({reused} prompt tokens reused)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
