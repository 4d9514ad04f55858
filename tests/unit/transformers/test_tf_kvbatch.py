"""KVBatch on its own: rows join right-aligned, leave with their columns trimmed, and come out
compact (holes from chunked prefill removed); GrowingLayer appends in place."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

torch = pytest.importorskip("torch")


def row(n: int, seed: int, layers: int = 2) -> Any:
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g))
                 for _ in range(layers))


def test_rows_join_right_aligned_and_leave_trimmed() -> None:
    from modelyard.engine.backends.transformers.kvbatch import KVBatch

    batch: KVBatch[str] = KVBatch(torch.device("cpu"))
    a, b = row(3, 1), row(5, 2)
    batch.add([("a", a), ("empty", None)])
    batch.add([("b", b)])
    assert batch.rows == ["a", "empty", "b"] and batch.length == 5
    assert batch.mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert batch.pos.tolist() == [3, 0, 5]
    assert batch.cache.get_seq_length() == 5
    for got, want in zip(batch.row_kv(0) or (), a, strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert batch.row_kv(1) is None
    batch.keep([0, 1])  # "b" leaves: two leading columns are nobody's any more
    assert batch.rows == ["a", "empty"] and batch.length == 3
    assert batch.mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    assert batch.cache.get_seq_length() == 3
    batch.keep([1])
    assert batch.length == 0 and batch.cache.get_seq_length() == 0
    batch.keep([])
    assert len(batch) == 0


def test_chunk_inputs_leave_holes_that_row_kv_compacts() -> None:
    from modelyard.engine.backends.transformers.kvbatch import KVBatch

    batch: KVBatch[str] = KVBatch(torch.device("cpu"))
    batch.add([("x", None), ("y", row(2, 3))])
    inputs = batch.chunk_inputs([[7, 8, 9], [5]], pad_id=0)
    assert inputs["input_ids"].tolist() == [[7, 8, 9], [0, 0, 5]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2], [2, 2, 2]]
    assert inputs["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [1, 1, 0, 0, 1]]
    # what the model's attention layers would do: append the chunk's K/V to every layer
    new = torch.arange(2 * 2 * 3 * 4, dtype=torch.float32).reshape(2, 2, 3, 4)
    for layer in batch.cache.layers:
        layer.update(new, new + 0.5)
    batch.advance(inputs)
    assert batch.pos.tolist() == [3, 3]
    kv = batch.row_kv(1)
    assert kv is not None and kv[0][0].shape == (1, 2, 3, 4)  # 2 cached + 1 new, no holes
    assert torch.equal(kv[0][0][0, :, 2], new[1, :, 2])


def test_growing_layer_appends_in_place() -> None:
    from modelyard.engine.backends.transformers.kvbatch import new_cache

    cache = new_cache()
    x = torch.ones(1, 2, 3, 4)
    cache.update(x, x, 0)
    first = cache.layers[0]._kbuf
    for i in range(10):
        k, _ = cache.update(x[:, :, :1] * i, x[:, :, :1], 0)
    assert cache.layers[0]._kbuf is first  # no reallocation within the spare columns
    assert k.shape == (1, 2, 13, 4) and float(k[0, 0, 12, 0]) == 9.0
    assert cache.get_seq_length() == 13
