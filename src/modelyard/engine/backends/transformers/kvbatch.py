"""Rows of sequences sharing one padded, batched `DynamicCache` (the layout before paged KV).

`BatchGenerator` uses the paged layout (`paged_kv.py`) by default; this one stays as the
`kv_layout="padded"` alternative, the baseline `bench/batch_core.py` measures paged KV against.

Layout: every layer holds keys/values `[rows, kv_heads, length, head_dim]` (views of buffers with
spare columns, which decode steps fill in place: see `GrowingLayer`); `mask[r, c]` says
whether column `c` of row `r` holds a real token (1) or padding (0), and `pos[r]` is the next
position id of row `r` (how many real tokens it has). Rows join on the left-padded side: a
joining row's KV is right-aligned to the batch's columns, so every row's *new* tokens are appended
at the same columns. Causality in transformers' masks is by column (the cache index), padding is
excluded by the 2D attention mask, and RoPE uses the explicit `position_ids`, so a row sees
exactly the tokens it would see alone.

Chunks of different lengths (prefill) are left-padded *inside* the appended segment, which leaves
holes in the middle of a row; they are masked out, and `row_kv()` compacts them away when a row
moves to the decode batch. Retiring rows copies the survivors (`index_select`) and trims leading
columns that no row uses any more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

T = TypeVar("T")
LayerKV = tuple[torch.Tensor, torch.Tensor]
RowKV = tuple[LayerKV, ...]  # one (keys, values) per layer, each [1, heads, n, head_dim]
SPARE = 64  # free columns a layer gets when (re)allocated, so the next steps append in place


class GrowingLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # (transformers' untyped)
    """A `DynamicLayer` that appends in place into a buffer with spare columns, instead of
    `torch.cat` copying the whole layer at every step (1.5x faster decode steps at 1-2k tokens
    of context, batch 8). `keys`/`values` are views of the filled part of the buffer."""

    _kbuf: torch.Tensor | None = None
    _vbuf: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.keys, self.values
        old = int(keys.shape[-2]) if keys is not None and keys.dim() == 4 else 0
        new = old + int(key_states.shape[-2])
        kbuf, vbuf = self._kbuf, self._vbuf
        if kbuf is None or vbuf is None or new > kbuf.shape[-2]:
            spare = max(SPARE, new // 4)
            kbuf = key_states.new_empty(*key_states.shape[:2], new + spare, key_states.shape[3])
            vbuf = value_states.new_empty(*value_states.shape[:2], new + spare,
                                          value_states.shape[3])
            if old and keys is not None and values is not None:
                kbuf[:, :, :old] = keys
                vbuf[:, :, :old] = values
            self._kbuf, self._vbuf = kbuf, vbuf
        kbuf[:, :, old:new] = key_states
        vbuf[:, :, old:new] = value_states
        self.keys, self.values = kbuf[:, :, :new], vbuf[:, :, :new]
        return self.keys, self.values


_growing_layer = cast(Callable[[], GrowingLayer], GrowingLayer)


def new_cache(buffers: Sequence[LayerKV] = (), length: int | None = None) -> Any:
    """A `DynamicCache` of `GrowingLayer`s over these (keys, values) buffers, which it now owns;
    the first `length` columns (all by default) are filled, the rest is room to grow."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    for kbuf, vbuf in buffers:
        n = kbuf.shape[2] if length is None else length
        layer = _growing_layer()
        layer.lazy_initialization(kbuf, vbuf)
        layer.keys, layer.values = kbuf[:, :, :n], vbuf[:, :, :n]
        layer._kbuf, layer._vbuf = kbuf, vbuf
        cache.layers.append(layer)
    return cache


def row_len(kv: RowKV | None) -> int:
    return 0 if not kv else int(kv[0][0].shape[2])


def slice_row(kv: RowKV, n: int) -> RowKV:
    return tuple((k[:, :, :n], v[:, :, :n]) for k, v in kv)


class KVBatch(Generic[T]):
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: list[T] = []
        self.cache = new_cache()
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.pos = torch.zeros(0, dtype=torch.long, device=device)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def lengths(self) -> list[int]:
        """Tokens each row holds."""
        return [int(n) for n in self.pos.tolist()]

    @property
    def tokens_held(self) -> int:
        return int(self.pos.sum()) if len(self.rows) else 0

    @property
    def bytes_allocated(self) -> int:
        """Bytes of the batch's KV buffers (padding and spare columns included)."""
        total = 0
        for layer in self.cache.layers:
            for buf in (getattr(layer, "_kbuf", None), getattr(layer, "_vbuf", None)):
                if isinstance(buf, torch.Tensor):
                    total += buf.nbytes
        return total

    def adopt(self, src: KVBatch[T], indices: Sequence[int],
              kvs: Sequence[RowKV | None] | None = None) -> None:
        """Append rows `indices` of `src` with their KV (`kvs[k]` when given, else copied from
        `src`); the caller drops them from `src` with `src.keep()`."""
        given = list(kvs) if kvs is not None else [None] * len(indices)
        self.add([(src.rows[i], kv if kv is not None else src.row_kv(i))
                  for kv, i in zip(given, indices, strict=True)])

    def _layers(self) -> list[LayerKV]:
        out: list[LayerKV] = []
        for layer in self.cache.layers:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) \
                    and keys.numel() > 0:
                out.append((keys, values))
        return out

    def _set_layers(self, buffers: Sequence[LayerKV], length: int | None = None) -> None:
        self.cache = new_cache(buffers, length)

    def add(self, rows: Sequence[tuple[T, RowKV | None]]) -> None:
        """Append rows, each with its (compact, unpadded) KV or None for a row with no KV yet."""
        if not rows:
            return
        old = self._layers()
        n_old, l_old = len(self.rows), self.length
        lengths = [row_len(kv) for _, kv in rows]
        length = max([l_old, *lengths])
        total = n_old + len(rows)
        mask = torch.zeros(total, length, dtype=torch.long, device=self.device)
        if n_old and l_old:
            mask[:n_old, length - l_old:] = self.mask
        for i, n in enumerate(lengths):
            if n:
                mask[n_old + i, length - n:] = 1
        ref: Sequence[LayerKV] | None = old or next((kv for _, kv in rows if kv and row_len(kv)),
                                                    None)
        if length and ref:
            layers: list[LayerKV] = []
            for j, (rk, rv) in enumerate(ref):
                k = rk.new_zeros(total, rk.shape[1], length + SPARE, rk.shape[3])
                v = rv.new_zeros(total, rv.shape[1], length + SPARE, rv.shape[3])
                if old and l_old:
                    k[:n_old, :, length - l_old:length] = old[j][0]
                    v[:n_old, :, length - l_old:length] = old[j][1]
                for i, (_, kv) in enumerate(rows):
                    n = lengths[i]
                    if kv and n:
                        k[n_old + i, :, length - n:length] = kv[j][0][0]
                        v[n_old + i, :, length - n:length] = kv[j][1][0]
                layers.append((k, v))
            self._set_layers(layers, length)
        else:
            self.cache = new_cache()
        self.mask = mask
        self.pos = torch.cat([self.pos, torch.tensor(lengths, dtype=torch.long,
                                                     device=self.device)])
        self.rows.extend(row for row, _ in rows)

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only these rows (in this order); trim columns no remaining row uses."""
        if list(indices) == list(range(len(self.rows))):
            return
        if not indices:
            self.rows = []
            self.cache = new_cache()
            self.mask = self.mask.new_zeros(0, 0)
            self.pos = self.pos.new_zeros(0)
            return
        idx = torch.tensor(list(indices), dtype=torch.long, device=self.device)
        mask = self.mask.index_select(0, idx)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else int(mask.shape[1])
        if start >= mask.shape[1]:
            self.cache = new_cache()  # no row has KV left
        else:
            self._set_layers([(k.index_select(0, idx)[:, :, start:],
                               v.index_select(0, idx)[:, :, start:]) for k, v in self._layers()])
        self.mask = mask[:, start:]
        self.pos = self.pos.index_select(0, idx)
        self.rows = [self.rows[i] for i in indices]

    def row_kv(self, i: int) -> RowKV | None:
        """Row `i`'s KV without padding or holes: a private copy, `[1, heads, pos[i], head_dim]`."""
        cols = self.mask[i].nonzero().squeeze(1)
        if cols.numel() == 0:
            return None
        return tuple((k[i:i + 1].index_select(2, cols), v[i:i + 1].index_select(2, cols))
                     for k, v in self._layers())

    def decode_inputs(self, last_tokens: Sequence[int]) -> dict[str, Any]:
        """Inputs for one decode step: each row's last token at its next position."""
        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device).unsqueeze(1)
        ones = self.mask.new_ones(len(self.rows), 1)
        return {"input_ids": ids, "attention_mask": torch.cat([self.mask, ones], dim=1),
                "position_ids": self.pos.unsqueeze(1), "past_key_values": self.cache}

    def chunk_inputs(self, chunks: Sequence[Sequence[int]], pad_id: int) -> dict[str, Any]:
        """Inputs appending a chunk per row, left-padded to the longest (a row may add none)."""
        width = max(len(c) for c in chunks)
        ids = [[pad_id] * (width - len(c)) + list(c) for c in chunks]
        seg = [[0] * (width - len(c)) + [1] * len(c) for c in chunks]
        starts = self.pos.tolist()
        pos = [[s] * (width - len(c)) + list(range(s, s + len(c)))
               for s, c in zip(starts, chunks, strict=True)]
        seg_t = torch.tensor(seg, dtype=torch.long, device=self.device)
        return {"input_ids": torch.tensor(ids, dtype=torch.long, device=self.device),
                "attention_mask": torch.cat([self.mask, seg_t], dim=1),
                "position_ids": torch.tensor(pos, dtype=torch.long, device=self.device),
                "past_key_values": self.cache}

    def advance(self, inputs: dict[str, Any]) -> None:
        """After the forward pass that consumed `inputs`: the new columns are part of the rows."""
        mask: torch.Tensor = inputs["attention_mask"]
        added = mask[:, self.length:].sum(dim=1)
        self.mask = mask
        self.pos = self.pos + added
