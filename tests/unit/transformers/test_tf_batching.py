"""BatchGenerator against model.generate: greedy output token for token, alone, in a batch,
with sequences joining mid-batch, through chunked prefill and through the prefix cache."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from modelyard.engine.backends.transformers.generator import BatchGenerator, TokenEvent
from modelyard.engine.backends.transformers.params import SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
TEXTS = [
    "The quick brown fox",
    "Hello",
    "A prefix cache keeps the KV of a shared system prompt. Continuous batching admits and "
    "retires sequences at every step, and streaming text must never break.",
    "日本語のテキストと絵文字 🙂",
    "def main():\n    return",
    "Continuous batching admits and retires sequences at every step.",
]


_REFERENCES: dict[tuple[Any, ...], list[int]] = {}


def reference(model: Any, ids: list[int], n: int, **kwargs: Any) -> list[int]:
    """`model.generate(do_sample=False)` for one prompt (memoised: the model never changes)."""
    import torch

    key = (id(model), tuple(ids), n, tuple(sorted(kwargs.items())))
    if key not in _REFERENCES:
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=n, **kwargs)
        _REFERENCES[key] = [int(t) for t in out[0, len(ids):]]
    return _REFERENCES[key]


async def collect(events: AsyncIterator[TokenEvent]) -> tuple[list[int], str, TokenEvent]:
    ids: list[int] = []
    text = ""
    last = None
    async for event in events:
        ids += event.token_ids
        text += event.text
        last = event
    assert last is not None and last.finish_reason is not None
    return ids, text, last


@pytest.fixture
def prompts(tokenizer: Any) -> list[list[int]]:
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.fixture
def refs(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    return [reference(model, p, GREEDY.max_tokens or 0) for p in prompts]


@pytest.fixture
async def gen(model: Any, tokenizer: Any) -> AsyncIterator[BatchGenerator]:
    g = BatchGenerator(model, tokenizer, max_batch_size=8, prefill_chunk_tokens=8,
                       prefix_cache_tokens=0)
    g.start()
    yield g
    g.stop()


async def test_greedy_one_at_a_time_equals_generate(
        gen: BatchGenerator, tokenizer: Any, prompts: list[list[int]],
        refs: list[list[int]]) -> None:
    assert len({len(p) for p in prompts}) == len(prompts)  # all different lengths
    for p, ref in zip(prompts, refs, strict=True):
        ids, text, last = await collect(gen.generate(p, GREEDY))
        assert ids == ref
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        eos = tokenizer.eos_token_id in ids
        assert last.finish_reason == ("stop" if eos else "length")
        assert last.usage == {"prompt_tokens": len(p), "completion_tokens": len(ref),
                              "cached_tokens": 0}
        assert last.timings is not None
        assert set(last.timings) == {"queue_ms", "prefill_ms", "decode_ms", "ttft_ms"}
        assert last.timings["ttft_ms"] >= last.timings["prefill_ms"] > 0


async def test_greedy_six_at_once_with_staggered_arrivals_equals_generate(
        gen: BatchGenerator, model: Any, prompts: list[list[int]],
        refs: list[list[int]]) -> None:
    """A long-running anchor decodes while six requests arrive one after another (each once the
    previous one has streamed 3 tokens), so every one of them joins a batch mid-flight (and, with
    8-token prefill chunks, sometimes while another prompt is still prefilling)."""
    results: list[Any] = [None] * len(prompts)
    started = [asyncio.Event() for _ in prompts]
    anchor_prompt = prompts[3]
    anchor = asyncio.ensure_future(collect(gen.generate(
        anchor_prompt, SamplingParams(temperature=0.0, max_tokens=120))))
    admitted: list[int] = []

    async def run(i: int) -> None:
        if i:
            await started[i - 1].wait()
        stats = gen.stats()
        admitted.append(stats["running"] + stats["waiting"])
        ids: list[int] = []
        async for event in gen.generate(prompts[i], GREEDY):
            ids += event.token_ids
            if len(ids) >= 3:
                started[i].set()
        started[i].set()
        results[i] = ids

    await asyncio.gather(*(run(i) for i in range(len(prompts))))
    anchor_ids, _, _ = await anchor
    assert results == refs
    assert anchor_ids == reference(model, anchor_prompt, 120)
    assert all(n >= 1 for n in admitted)  # each arrived while others were running
    stats = gen.stats()
    hist = {int(k): v for k, v in stats["batch_size_hist"].items()}
    assert max(hist) >= 3 and len(hist) >= 3  # the batch grew and shrank step by step
    assert stats["tokens_generated"] == sum(len(r) for r in refs) + len(anchor_ids)


async def test_greedy_all_at_once_and_prefilled_together(
        gen: BatchGenerator, prompts: list[list[int]], refs: list[list[int]]) -> None:
    outs = await asyncio.gather(*(collect(gen.generate(p, GREEDY)) for p in prompts))
    assert [ids for ids, _, _ in outs] == refs


async def test_more_requests_than_slots_wait_their_turn(
        model: Any, tokenizer: Any, prompts: list[list[int]], refs: list[list[int]]) -> None:
    g = BatchGenerator(model, tokenizer, max_batch_size=2, max_batch_tokens=16,
                       prefill_chunk_tokens=4, prefix_cache_tokens=0)
    g.start()
    try:
        outs = await asyncio.gather(*(collect(g.generate(p, GREEDY)) for p in prompts))
        assert [ids for ids, _, _ in outs] == refs
        assert max(int(k) for k in g.stats()["batch_size_hist"]) <= 2
        assert max(last.timings["queue_ms"] for _, _, last in outs if last.timings) > 0
    finally:
        g.stop()


async def test_repetition_penalty_matches_generate(
        gen: BatchGenerator, model: Any, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.5)
    refs = [reference(model, p, 20, repetition_penalty=1.5) for p in prompts[:3]]
    outs = await asyncio.gather(*(collect(gen.generate(p, params)) for p in prompts[:3]))
    assert [ids for ids, _, _ in outs] == refs


async def test_prefix_cache_reuses_a_shared_prefix_with_identical_output(
        model: Any, tokenizer: Any) -> None:
    g = BatchGenerator(model, tokenizer, prefill_chunk_tokens=16, prefix_cache_tokens=4096)
    g.start()
    try:
        system = tokenizer.encode(" ".join(TEXTS[:3]) * 2)
        assert len(system) > 100
        first = system + tokenizer.encode(" First question?")
        second = system + tokenizer.encode(" Another one!")
        ids1, _, last1 = await collect(g.generate(first, GREEDY))
        assert last1.usage is not None and last1.usage["cached_tokens"] == 0
        ids2, _, last2 = await collect(g.generate(second, GREEDY))
        assert last2.usage is not None and last2.usage["cached_tokens"] >= len(system)
        assert ids1 == reference(model, first, 24)
        assert ids2 == reference(model, second, 24)  # same as a cold run
        # the next turn of the first chat reuses the prompt and the answer
        turn2 = first + ids1 + tokenizer.encode(" And then?")
        ids3, _, last3 = await collect(g.generate(turn2, GREEDY))
        assert last3.usage is not None
        assert last3.usage["cached_tokens"] == len(first) + len(ids1) - 1
        assert ids3 == reference(model, turn2, 24)
        cache = g.stats()["prefix_cache"]
        assert cache["hits"] >= 2 and cache["misses"] >= 1
        assert 0 < cache["hit_rate"] < 1 and cache["tokens_cached"] > 0
        assert g.stats()["prompt_tokens_computed"] < g.stats()["prompt_tokens"]
    finally:
        g.stop()


async def test_chunked_prefill_does_not_stall_running_streams(
        model: Any, tokenizer: Any) -> None:
    log: list[tuple[str, int]] = []

    class Recording(BatchGenerator):
        def _prefill_step(self) -> None:
            log.append(("chunk", len(self._prefilling)))
            super()._prefill_step()

        def _accept(self, seq: Any, choice: Any) -> None:
            log.append(("token", seq.id))
            super()._accept(seq, choice)

    g = Recording(model, tokenizer, prefill_chunk_tokens=32, prefix_cache_tokens=0)
    g.start()
    try:
        short = tokenizer.encode("Hello")
        long_prompt = tokenizer.encode(" ".join(TEXTS) * 4)
        assert len(long_prompt) > 300
        streaming = gen_task = None
        streaming = g.generate(short, SamplingParams(temperature=0.0, max_tokens=60))
        first = await streaming.__anext__()  # the short one is decoding
        assert first.token_ids
        gen_task = asyncio.ensure_future(collect(g.generate(long_prompt, GREEDY)))
        rest = await collect(streaming)
        long_ids, _, _ = await gen_task
        assert [*first.token_ids, *rest[0]] == reference(model, short, 60)[:len(rest[0]) + 1]
        assert long_ids == reference(model, long_prompt, 24)
    finally:
        g.stop()
    # between the long prompt's first chunk and its first token, the short one kept streaming
    start = next(i for i, e in enumerate(log) if e == ("chunk", 1) and i > 3)
    end = next(i for i, e in enumerate(log) if e == ("token", 1))
    window = log[start:end]
    chunks = sum(1 for kind, _ in window if kind == "chunk")
    tokens = sum(1 for e in window if e == ("token", 0))
    assert chunks >= len(long_prompt) // 32
    assert tokens >= chunks - 1


async def test_concurrent_prompts_are_prefilled_together(model: Any, tokenizer: Any) -> None:
    rows: list[int] = []

    class Recording(BatchGenerator):
        def _prefill_step(self) -> None:
            rows.append(len(self._prefilling))
            super()._prefill_step()

    g = Recording(model, tokenizer, prefill_chunk_tokens=8, prefix_cache_tokens=0)
    g.start()
    try:
        long_prompt = tokenizer.encode(" ".join(TEXTS))
        busy = asyncio.ensure_future(collect(g.generate(long_prompt, GREEDY)))
        await asyncio.sleep(0.01)
        outs = await asyncio.gather(*(collect(g.generate(tokenizer.encode(t), GREEDY))
                                      for t in TEXTS[:4]))
        await busy
        assert max(rows) >= 4
        assert [o[0] for o in outs] == [reference(model, tokenizer.encode(t), 24)
                                        for t in TEXTS[:4]]
    finally:
        g.stop()
