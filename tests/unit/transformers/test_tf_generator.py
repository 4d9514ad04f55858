"""BatchGenerator's request features: seeds, stop strings, max_tokens, logprobs, penalties,
cancellation (the slot frees, the others are unchanged), stop(), and bad prompts."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from modelyard.engine.backends.transformers.generator import BatchGenerator, TokenEvent
from modelyard.engine.backends.transformers.params import (
    ContextOverflow,
    InvalidParams,
    SamplingParams,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PROMPTS = ["The quick brown fox", "Hello world!", "日本語のテキスト", "def main():"]


async def collect(events: AsyncIterator[TokenEvent]) -> tuple[list[int], str, TokenEvent]:
    ids: list[int] = []
    text = ""
    last = None
    async for event in events:
        ids += event.token_ids
        text += event.text
        last = event
    assert last is not None
    return ids, text, last


@pytest.fixture
async def gen(model: Any, tokenizer: Any) -> AsyncIterator[BatchGenerator]:
    g = BatchGenerator(model, tokenizer, max_batch_size=4, prefill_chunk_tokens=16)
    g.start()
    yield g
    g.stop()


async def test_a_seed_makes_sampling_reproducible_alone_or_in_a_batch(
        gen: BatchGenerator, tokenizer: Any) -> None:
    prompt = tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=1.2, top_p=0.95, top_k=50, min_p=0.01, seed=1234,
                            max_tokens=30)
    alone, _, _ = await collect(gen.generate(prompt, params))
    again, _, _ = await collect(gen.generate(prompt, params))
    others = [gen.generate(tokenizer.encode(p), SamplingParams(temperature=1.0, max_tokens=30))
              for p in PROMPTS[1:]]
    crowded, *_ = await asyncio.gather(collect(gen.generate(prompt, params)),
                                       *(collect(o) for o in others))
    other_seed, _, _ = await collect(gen.generate(prompt, SamplingParams(
        temperature=1.2, top_p=0.95, top_k=50, min_p=0.01, seed=99, max_tokens=30)))
    assert alone == again == crowded[0]
    assert other_seed != alone


async def test_top_k_one_and_temperature_zero_are_greedy(gen: BatchGenerator,
                                                         tokenizer: Any) -> None:
    prompt = tokenizer.encode(PROMPTS[1])
    greedy, _, _ = await collect(gen.generate(prompt, SamplingParams(temperature=0,
                                                                     max_tokens=20)))
    top1, _, _ = await collect(gen.generate(prompt, SamplingParams(top_k=1, max_tokens=20)))
    tiny_p, _, _ = await collect(gen.generate(prompt, SamplingParams(top_p=1e-6, seed=5,
                                                                     max_tokens=20)))
    assert greedy == top1 == tiny_p


async def test_max_tokens_finishes_with_length(gen: BatchGenerator, tokenizer: Any) -> None:
    prompt = tokenizer.encode(PROMPTS[0])
    ids, text, last = await collect(gen.generate(prompt, SamplingParams(
        temperature=0, max_tokens=5)))
    assert tokenizer.eos_token_id not in ids  # (this prompt does not hit EOS early)
    assert len(ids) == 5 and last.finish_reason == "length"
    assert last.usage == {"prompt_tokens": len(prompt), "completion_tokens": 5,
                          "cached_tokens": last.usage["cached_tokens"] if last.usage else -1}
    assert text == tokenizer.decode(ids)


async def test_stop_string_across_token_boundaries(gen: BatchGenerator, tokenizer: Any) -> None:
    prompt = tokenizer.encode(PROMPTS[0])
    greedy = SamplingParams(temperature=0, max_tokens=40)
    ids, text, _ = await collect(gen.generate(prompt, greedy))
    # per-token texts, to find a stop string that spans two tokens
    pieces = [tokenizer.decode(ids[:i + 1]) for i in range(len(ids))]
    ends = [len(p) for p in pieces]
    cut = next(e for p, e in zip(pieces[3:], ends[3:], strict=True)
               if text.startswith(p) and e + 1 < len(text) and "\ufffd" not in text[e - 1:e + 1])
    stop = text[cut - 1:cut + 1]
    assert text.find(stop) < len(text) - 2
    out_ids, out_text, last = await collect(gen.generate(prompt, SamplingParams(
        temperature=0, max_tokens=40, stop=(stop, "never-seen"))))
    assert last.finish_reason == "stop"
    assert out_text == text[:text.find(stop)]
    assert stop not in out_text
    assert out_ids == ids[:len(out_ids)] and len(out_ids) < len(ids)


async def test_eos_finishes_with_stop(model: Any, tokenizer: Any) -> None:
    """Make EOS the most likely token by biasing the output layer (a copy of the model)."""
    import copy

    import torch

    eos_model = copy.deepcopy(model)
    with torch.no_grad():
        eos_model.lm_head.weight[tokenizer.eos_token_id] *= 0
        eos_model.lm_head.weight[tokenizer.eos_token_id] += eos_model.lm_head.weight.sum(0)
    g = BatchGenerator(eos_model, tokenizer)
    g.start()
    try:
        found = []
        for p in PROMPTS:
            ids, text, last = await collect(g.generate(tokenizer.encode(p), SamplingParams(
                temperature=0, max_tokens=50)))
            if last.finish_reason == "stop":
                assert ids[-1] == tokenizer.eos_token_id and "</s>" not in text
                found.append(p)
        assert found
        ids, _, last = await collect(g.generate(tokenizer.encode(found[0]), SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True)))
        assert len(ids) == 12 and last.finish_reason == "length"
    finally:
        g.stop()


async def test_logprobs_top_n(gen: BatchGenerator, tokenizer: Any) -> None:
    prompt = tokenizer.encode(PROMPTS[2])
    events = [e async for e in gen.generate(prompt, SamplingParams(temperature=0, max_tokens=8,
                                                                   logprobs=3))]
    entries = [entry for e in events for entry in (e.logprobs or [])]
    assert len(entries) == sum(len(e.token_ids) for e in events)
    for event in events:
        for token, entry in zip(event.token_ids, event.logprobs or [], strict=True):
            assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
            tops = [t["logprob"] for t in entry["top_logprobs"]]
            assert tops == sorted(tops, reverse=True)
            assert math.isclose(tops[0], entry["logprob"], abs_tol=1e-5)  # greedy = the top one
            assert entry["token"] == tokenizer.decode([token])
            assert isinstance(entry["bytes"], list)
    plain = [e async for e in gen.generate(prompt, SamplingParams(temperature=0, max_tokens=3))]
    assert all(e.logprobs is None for e in plain)
    zero = [e async for e in gen.generate(prompt, SamplingParams(temperature=0, max_tokens=3,
                                                                 logprobs=0))]
    assert all(entry["top_logprobs"] == [] for e in zero for entry in e.logprobs or [])


async def test_presence_and_frequency_penalties_discourage_repeats(
        gen: BatchGenerator, tokenizer: Any) -> None:
    prompt = tokenizer.encode(PROMPTS[3])
    plain, _, _ = await collect(gen.generate(prompt, SamplingParams(temperature=0,
                                                                    max_tokens=40)))
    penalized, _, _ = await collect(gen.generate(prompt, SamplingParams(
        temperature=0, max_tokens=40, frequency_penalty=2.0, presence_penalty=2.0)))
    assert len(set(penalized)) > len(set(plain))


async def test_cancelling_one_stream_frees_its_slot_and_leaves_the_others_unchanged(
        model: Any, tokenizer: Any) -> None:
    params = SamplingParams(temperature=0, max_tokens=300)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    g = BatchGenerator(model, tokenizer, max_batch_size=3, prefix_cache_tokens=0)
    g.start()
    try:
        alone = await asyncio.gather(*(collect(g.generate(p, params)) for p in prompts[:2]))

        victim = g.generate(prompts[2], params)
        streams = [g.generate(p, params) for p in prompts[:2]]
        tasks = [asyncio.ensure_future(collect(s)) for s in streams]
        got = 0
        async for event in victim:
            got += len(event.token_ids)
            if got >= 5:
                break
        assert g.stats()["running"] == 3
        await victim.aclose()
        deadline = time.monotonic() + 5
        while g.stats()["running"] != 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        assert g.stats()["running"] == 2  # the others are still generating
        # the freed slot takes a new request while the others still run
        late = await collect(g.generate(prompts[0], SamplingParams(temperature=0, max_tokens=3)))
        assert late[0] == alone[0][0][:3]
        results = await asyncio.gather(*tasks)
    finally:
        g.stop()
    assert [r[0] for r in results] == [a[0] for a in alone]
    assert g.stats()["running"] == 0


async def test_cancelling_the_consuming_task_cancels_the_sequence(
        gen: BatchGenerator, tokenizer: Any) -> None:
    # greedy from this prompt runs 900 tokens without EOS
    events = gen.generate(tokenizer.encode(PROMPTS[0]), SamplingParams(temperature=0,
                                                                       max_tokens=900))
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in events:  # cancelled while awaiting the next event
            first.set()

    task = asyncio.ensure_future(consume())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 5
    while gen.stats()["running"] and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    assert gen.stats()["running"] == 0
    assert gen.stats()["tokens_generated"] < 900


async def test_dropping_an_unfinished_stream_cancels_its_sequence(
        gen: BatchGenerator, tokenizer: Any) -> None:
    import gc

    events = gen.generate(tokenizer.encode(PROMPTS[0]), SamplingParams(temperature=0,
                                                                       max_tokens=900))
    await events.__anext__()
    del events
    gc.collect()
    deadline = time.monotonic() + 5
    while gen.stats()["running"] and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    assert gen.stats()["running"] == 0
    assert gen.stats()["tokens_generated"] < 900


async def test_stop_ends_streams_in_flight_with_cancelled(model: Any, tokenizer: Any) -> None:
    g = BatchGenerator(model, tokenizer)
    g.start()
    # ignore_eos: the tiny model samples at temperature 1, and an end-of-sequence as the first
    # token (seen in CI) would finish the stream before stop() had anything to cancel.
    events = g.generate(tokenizer.encode(PROMPTS[0]),
                        SamplingParams(max_tokens=800, ignore_eos=True))
    first = await events.__anext__()
    assert first.finish_reason is None
    await asyncio.to_thread(g.stop)
    rest = [e async for e in events]
    assert rest[-1].finish_reason == "cancelled"
    assert rest[-1].usage is not None and rest[-1].usage["completion_tokens"] < 800
    with pytest.raises(RuntimeError):
        g.generate([1, 2], SamplingParams())


async def test_bad_prompts_are_refused_before_queueing(gen: BatchGenerator) -> None:
    with pytest.raises(InvalidParams) as info:
        gen.generate([], SamplingParams())
    assert info.value.param == "prompt"
    with pytest.raises(ContextOverflow) as overflow:
        gen.generate([5] * 5000, SamplingParams())  # the tiny model's context is 1024
    assert (overflow.value.n_prompt, overflow.value.n_ctx) == (5000, 1024)


async def test_max_tokens_is_clamped_to_the_context(gen: BatchGenerator) -> None:
    ids, _, last = await collect(gen.generate([5] * 1020, SamplingParams(temperature=0,
                                                                          max_tokens=50)))
    assert len(ids) <= 4
    assert last.finish_reason in ("length", "stop")


async def test_stats_shape(gen: BatchGenerator, tokenizer: Any) -> None:
    await collect(gen.generate(tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=4)))
    stats = gen.stats()
    for key in ("running", "waiting", "steps", "batch_size_avg", "batch_size_hist",
                "tokens_generated", "prefix_cache"):
        assert key in stats
    assert set(stats["prefix_cache"]) >= {"hits", "misses", "hit_rate", "tokens_cached"}
    assert stats["steps"] >= 3 and stats["tokens_generated"] == 4
    # 2 layers x 2 KV heads x 16 dims x (K and V) x 4 bytes
    assert stats["kv_bytes_per_token"] == 2 * 2 * 16 * 2 * 4
    assert stats["prefix_cache"]["bytes"] == stats["prefix_cache"]["tokens_cached"] * 512


async def test_a_failed_step_fails_its_sequences_and_the_worker_goes_on(
        model: Any, tokenizer: Any) -> None:
    class Flaky(BatchGenerator):
        fail = True

        def _forward(self, inputs: dict[str, Any]) -> Any:
            if self.fail:
                self.fail = False
                raise RuntimeError("out of memory (simulated)")
            return super()._forward(inputs)

    g = Flaky(model, tokenizer)
    g.start()
    try:
        with pytest.raises(RuntimeError, match="simulated"):
            await collect(g.generate(tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=4)))
        ids, _, last = await collect(g.generate(tokenizer.encode(PROMPTS[0]),
                                                SamplingParams(max_tokens=4)))
        assert len(ids) == 4 and last.finish_reason == "length"
        assert g.stats()["errors"] == 1 and g.stats()["running"] == 0
    finally:
        g.stop()
