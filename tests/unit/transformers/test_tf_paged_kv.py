"""Paged KV on its own (blocks, free list, block tables, the step's mask and slots) and in the
generator: memory follows the tokens held, greedy output is the padded layout's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

torch = pytest.importorskip("torch")


def row(n: int, seed: int, layers: int = 2) -> Any:
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g))
                 for _ in range(layers))


def same(a: Any, b: Any) -> bool:
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
               for x, y in zip(a, b, strict=True))


def test_the_pool_hands_out_blocks_never_the_scratch_one_and_frees_memory_when_empty() -> None:
    from modelyard.engine.backends.transformers.paged_kv import SCRATCH, BlockPool

    pool = BlockPool(torch.device("cpu"), block_tokens=4, min_blocks=4)
    first = pool.allocate(3)
    assert SCRATCH not in first and pool.used == 3 and pool.capacity == 4
    pool.layer(0, torch.zeros(1, 2, 1, 4))
    pool.keys[0][:, first[0] * 4] = 7.0
    more = pool.allocate(5)  # grows, keeping what the first blocks hold
    assert pool.capacity >= 9 and SCRATCH not in more and not set(first) & set(more)
    assert float(pool.keys[0][0, first[0] * 4, 0]) == 7.0
    pool.release(first)
    assert pool.used == 5 and pool.bytes_allocated > 0
    pool.release(more)
    assert pool.used == 0 and pool.bytes_allocated == 0 and pool.capacity == 0


def test_rows_hold_blocks_for_their_own_tokens_not_the_longest_row() -> None:
    from modelyard.engine.backends.transformers.paged_kv import BlockPool, PagedBatch

    pool = BlockPool(torch.device("cpu"), block_tokens=16)
    batch: PagedBatch[str] = PagedBatch(pool)
    short, long = row(3, 1), row(40, 2)
    batch.add([("short", short), ("empty", None), ("long", long)])
    assert batch.lengths() == [3, 0, 40] and batch.tokens_held == 43
    assert pool.used == 1 + 3  # a padded batch would hold 3 rows x 40 columns
    got = batch.row_kv(0)
    assert got is not None and same(got, short)
    got = batch.row_kv(2)
    assert got is not None and same(got, long)
    assert batch.row_kv(1) is None
    batch.keep([0, 1])
    assert pool.used == 1 and batch.rows == ["short", "empty"]
    batch.keep([])
    assert pool.used == 0 and pool.bytes_allocated == 0


def test_a_row_moves_between_batches_without_a_copy() -> None:
    from modelyard.engine.backends.transformers.paged_kv import BlockPool, PagedBatch

    pool = BlockPool(torch.device("cpu"), block_tokens=4)
    prefilling: PagedBatch[str] = PagedBatch(pool)
    running: PagedBatch[str] = PagedBatch(pool)
    a, b = row(5, 3), row(2, 4)
    prefilling.add([("a", a), ("b", b)])
    blocks = list(prefilling._blocks[0])
    running.adopt(prefilling, [0])
    prefilling.keep([1])
    assert running.rows == ["a"] and running._blocks[0] == blocks and pool.used == 2 + 1
    got = running.row_kv(0)
    assert got is not None and same(got, a)
    other: PagedBatch[str] = PagedBatch(BlockPool(torch.device("cpu")))
    with pytest.raises(ValueError):
        other.adopt(running, [0])


def test_a_step_writes_only_real_tokens_and_each_query_sees_its_own_past() -> None:
    from modelyard.engine.backends.transformers.paged_kv import SCRATCH, BlockPool, PagedBatch

    pool = BlockPool(torch.device("cpu"), block_tokens=2)
    batch: PagedBatch[str] = PagedBatch(pool)
    batch.add([("x", None), ("y", row(3, 5))])
    inputs = batch.chunk_inputs([[7, 8, 9], [5]], pad_id=0)
    assert inputs["input_ids"].tolist() == [[7, 8, 9], [0, 0, 5]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2], [3, 3, 3]]
    mask = inputs["attention_mask"]
    assert mask.shape == (2, 1, 3, batch.width) and mask.dtype == torch.bool
    # "x" (no past): token t sees columns <= t; "y": its two pads see column 0, token 3 sees 0..3
    assert mask[0, 0].long().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
    assert mask[1, 0].long().tolist() == [[1, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    write = batch._write
    assert write is not None and write.tolist()[3:5] == [SCRATCH, SCRATCH]
    new = torch.arange(2 * 2 * 3 * 4, dtype=torch.float32).reshape(2, 2, 3, 4)
    for j in range(2):  # what the model's attention layers do
        keys, _ = batch.cache.update(new, new + 0.5, j)
        assert keys.shape == (2, 2, batch.width, 4)
        assert torch.equal(keys[1, :, 3], new[1, :, 2])  # y's new token is its column 3
    batch.advance(inputs)
    assert batch.lengths() == [3, 4]
    kv = batch.row_kv(1)
    assert kv is not None and kv[0][0].shape == (1, 2, 4, 4)
    assert torch.equal(kv[0][0][0, :, 3], new[1, :, 2])


def test_an_eager_model_gets_an_additive_mask() -> None:
    from modelyard.engine.backends.transformers.paged_kv import BlockPool, PagedBatch

    batch: PagedBatch[str] = PagedBatch(BlockPool(torch.device("cpu")), torch.float32)
    batch.add([("x", row(2, 6))])
    mask = batch.decode_inputs([1])["attention_mask"]
    assert mask.dtype == torch.float32
    assert mask[0, 0, 0, :3].tolist() == [0.0, 0.0, 0.0]
    assert float(mask[0, 0, 0, 3]) == torch.finfo(torch.float32).min


async def _run(gen: Any, prompts: list[list[int]], outs: list[int]) -> list[list[int]]:
    from modelyard.engine.backends.transformers.params import SamplingParams

    async def one(ids: list[int], n: int) -> list[int]:
        got: list[int] = []
        async for event in gen.generate(ids, SamplingParams(temperature=0.0, max_tokens=n,
                                                            ignore_eos=True)):
            got += event.token_ids
        return got

    return list(await asyncio.gather(*(one(p, n) for p, n in zip(prompts, outs, strict=True))))


async def test_mixed_lengths_hold_less_kv_paged_with_the_same_greedy_output(
        model: Any, tokenizer: Any) -> None:
    from modelyard.engine.backends.transformers.generator import BatchGenerator

    text = "Continuous batching admits and retires sequences at every step. " * 6
    prompts = [tokenizer.encode(text)[:n] for n in (4, 90, 7, 12, 60, 3)]
    outs = [20, 6, 30, 9, 16, 24]
    found: dict[str, Any] = {}
    for layout in ("padded", "paged"):
        gen = BatchGenerator(model, tokenizer, max_batch_size=6, prefill_chunk_tokens=16,
                             prefix_cache_tokens=0, kv_layout=layout)
        gen.start()
        try:
            found[layout] = (await _run(gen, prompts, outs), gen.stats())
        finally:
            gen.stop()
    assert found["paged"][0] == found["padded"][0]
    paged, padded = found["paged"][1], found["padded"][1]
    assert paged["kv_layout"] == "paged" and padded["kv_layout"] == "padded"
    assert paged["kv_tokens_held_peak"] == padded["kv_tokens_held_peak"] > 0
    assert paged["kv_bytes_peak"] < padded["kv_bytes_peak"]
    # nothing in flight: the paged pool gave its memory back
    assert paged["kv_tokens_held"] == 0 and paged["kv_bytes_allocated"] == 0


def test_an_unknown_layout_is_refused_and_flash_attention_keeps_the_padded_one(
        model: Any, tokenizer: Any) -> None:
    from modelyard.engine.backends.transformers.generator import BatchGenerator, _no_paged

    with pytest.raises(ValueError):
        BatchGenerator(model, tokenizer, kv_layout="ragged")
    assert _no_paged(model) is None

    class Config:
        _attn_implementation = "flash_attention_2"

    class Flash:
        config = Config()

    assert _no_paged(Flash()) is not None
