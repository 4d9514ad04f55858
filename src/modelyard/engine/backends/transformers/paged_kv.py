"""Paged KV: rows of sequences whose keys/values live in fixed-size blocks of one shared pool.

Why: the padded layout (`kvbatch.KVBatch`) keeps a batch as `[rows, heads, longest row, dim]`
per layer, so its memory is rows x the longest row (plus the holes chunked prefill leaves), and
every join or retirement copies the whole batch. Here a sequence holds `ceil(tokens /
block_tokens)` blocks, listed in its *block table*; blocks come from a free list and go back when
the row leaves, so KV memory grows with the tokens each sequence holds. A row moves from the
prefilling batch to the decode batch by handing over its block table (no copy).

Layout: per layer, keys and values are `[kv_heads, blocks * block_tokens, head_dim]` tensors
(`slot = block * block_tokens + offset`). Block 0 is never handed out: it is the scratch block
that padding reads and writes, so it always holds finite values. The pool grows by reallocating
(amortised, x1.25) when the free list runs dry, and gives its memory back as soon as no row
holds a block.

Attention runs through the model's own attention code (sdpa or eager, same RoPE and kernels as
`generate`): the cache's `update()` scatters the step's new keys/values into their slots, then
gathers each row's blocks, in table order, into a transient `[rows, kv_heads, blocks x
block_tokens, head_dim]` view for that one layer (only one layer's copy exists at a time). A
row's token `t` is column `t` of that view, so the step passes its own 4D mask (query at token
`t` sees columns `<= t` of its row; transformers takes a 4D mask as is) instead of the 2D padding
mask. Two measured choices (bench/batch_core.py, CPU): head-major storage, since attention over
a token-major view (`heads * dim` between tokens) took twice as long; and whole blocks gathered
rather than right-aligned tokens, since copying `block_tokens * head_dim` values per index
instead of `head_dim` made the gather several times cheaper.

Models: full-attention layers only (no sliding window: the 4D mask would override it); the
generator keeps the padded layout for others.
"""


from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import torch
from transformers.cache_utils import Cache

T = TypeVar("T")
LayerKV = tuple[torch.Tensor, torch.Tensor]
RowKV = tuple[LayerKV, ...]  # one (keys, values) per layer, each [1, heads, n, head_dim]
SCRATCH = 0  # the block (and slot) padding points at


class BlockPool:
    """Blocks of `block_tokens` token slots for every layer's keys and values, and a free list.

    Storage is created lazily (shape and dtype from the first keys seen) and dropped when the
    last block is released. Not thread-safe: only the generator's worker touches it."""

    def __init__(self, device: torch.device, block_tokens: int = 16, min_blocks: int = 32) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.device = device
        self.block_tokens = block_tokens
        self.min_blocks = max(2, min_blocks)
        self.keys: list[torch.Tensor] = []  # per layer [heads, capacity * block_tokens, dim]
        self.values: list[torch.Tensor] = []
        self.capacity = 0  # blocks, scratch included
        self._free: list[int] = []
        self._like: torch.Tensor | None = None  # a [1, heads, 1, dim] tensor of the KV's dtype
        self.peak_blocks = 0

    @property
    def used(self) -> int:
        """Blocks held by rows (the scratch block not counted)."""
        return max(0, self.capacity - 1 - len(self._free))

    @property
    def bytes_allocated(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)

    def allocate(self, n: int) -> list[int]:
        if n <= 0:
            return []
        if n > len(self._free):
            self._grow(self.capacity + n - len(self._free))
        out = self._free[-n:][::-1]
        del self._free[-n:]
        self.peak_blocks = max(self.peak_blocks, self.used)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)
        if self.capacity and len(self._free) == self.capacity - 1:
            self.reset()  # nobody holds KV: give the memory back

    def reset(self) -> None:
        self.keys, self.values, self._free, self.capacity = [], [], [], 0

    def _grow(self, need: int) -> None:
        old = self.capacity
        new = max(need, self.min_blocks, old + old // 4)
        slots = new * self.block_tokens
        for store in (self.keys, self.values):
            for j, t in enumerate(store):
                grown = t.new_zeros(t.shape[0], slots, t.shape[2])
                grown[:, :t.shape[1]] = t
                store[j] = grown
        first = max(old, 1)  # block 0 is the scratch block
        self._free[:0] = range(new - 1, first - 1, -1)  # handed out lowest first
        self.capacity = new

    def layer(self, j: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `j`'s (keys, values) storage; `like` ([rows, heads, n, dim]) sizes a new one."""
        while len(self.keys) <= j:
            shape = (like.shape[1], self.capacity * self.block_tokens, like.shape[3])
            self.keys.append(like.new_zeros(shape))
            self.values.append(like.new_zeros(shape))
        return self.keys[j], self.values[j]


def slots_of(blocks: Sequence[int], n: int, block_tokens: int) -> list[int]:
    """The slots of a row's first `n` tokens."""
    return [blocks[t // block_tokens] * block_tokens + t % block_tokens for t in range(n)]


class PagedCache(Cache):
    """The `Cache` a forward pass sees: `update()` stores the new KV in the pool and returns the
    rows' blocks for this step (see the module docstring)."""

    def __init__(self, batch: PagedBatch[Any]) -> None:
        super().__init__(layers=[])
        self._batch = batch

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self._batch.attend(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._batch.length

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._batch.length

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self._batch.width, 0


class PagedBatch(Generic[T]):
    """Rows of sequences, each with a block table in `pool` and a token count. The API is the
    padded `KVBatch`'s, plus `adopt()` to move rows between batches of the same pool.
    `mask_dtype`: None for a boolean mask (sdpa), or the dtype of an additive one (eager)."""

    def __init__(self, pool: BlockPool, mask_dtype: torch.dtype | None = None) -> None:
        self.pool = pool
        self.device = pool.device
        self.mask_dtype = mask_dtype
        self.rows: list[T] = []
        self._blocks: list[list[int]] = []
        self._lens: list[int] = []
        self._table: torch.Tensor | None = None  # [rows, max blocks], rebuilt when blocks change
        self.cache = PagedCache(self)
        self.width = 0  # the step's columns (max blocks x block_tokens)
        self._chunk: list[int] = []  # tokens each row appends in the step
        self._write: torch.Tensor | None = None  # [rows * new] slots the step's KV goes to
        self._flat: torch.Tensor | None = None  # [heads * rows * max blocks] rows of a 2D view
        # the gathered keys and values, reused by every layer and step (grown when too small):
        # a fresh 1-4 MB tensor per layer cost more in page faults than the copy itself
        self._bufs: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def length(self) -> int:
        """The longest row, tokens."""
        return max(self._lens, default=0)

    def lengths(self) -> list[int]:
        return list(self._lens)

    @property
    def tokens_held(self) -> int:
        return sum(self._lens)

    def _blocks_for(self, i: int, n: int) -> None:
        """Give row `i` blocks for `n` tokens in all."""
        need = -(-n // self.pool.block_tokens) - len(self._blocks[i])
        if need > 0:
            self._blocks[i].extend(self.pool.allocate(need))
            self._table = None

    def add(self, rows: Sequence[tuple[T, RowKV | None]]) -> None:
        """Append rows, each with its (compact, unpadded) KV, copied into new blocks, or None."""
        start = len(self.rows)
        try:
            for k, (row, kv) in enumerate(rows):
                self.rows.append(row)
                self._blocks.append([])
                self._lens.append(0)
                n = int(kv[0][0].shape[2]) if kv else 0
                if not kv or not n:
                    continue
                i = start + k
                self._blocks_for(i, n)
                idx = torch.tensor(slots_of(self._blocks[i], n, self.pool.block_tokens),
                                   dtype=torch.long, device=self.device)
                for j, (rk, rv) in enumerate(kv):
                    keys, values = self.pool.layer(j, rk)
                    keys.index_copy_(1, idx, rk[0])
                    values.index_copy_(1, idx, rv[0])
                self._lens[i] = n
        except BaseException:
            self.keep(list(range(start)))  # a failed join leaves the batch as it was
            raise
        self._table = None

    def adopt(self, src: PagedBatch[T], indices: Sequence[int],
              kvs: Sequence[RowKV | None] | None = None) -> None:
        """Move rows `indices` of `src` (same pool) here, KV and all (`kvs` is not needed: the
        blocks move); they become empty rows in `src`, which the caller drops with `src.keep()`."""
        if src.pool is not self.pool:
            raise ValueError("rows can only move between batches of one pool")
        for i in indices:
            self.rows.append(src.rows[i])
            self._blocks.append(src._blocks[i])
            self._lens.append(src._lens[i])
            src._blocks[i], src._lens[i] = [], 0
        self._table = src._table = None

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only these rows (in this order); the others' blocks go back to the pool."""
        kept = set(indices)
        for i, blocks in enumerate(self._blocks):
            if i not in kept and blocks:
                self.pool.release(blocks)
        self.rows = [self.rows[i] for i in indices]
        self._blocks = [self._blocks[i] for i in indices]
        self._lens = [self._lens[i] for i in indices]
        self._table = None

    def row_kv(self, i: int) -> RowKV | None:
        """Row `i`'s KV: a private contiguous copy, `[1, heads, tokens, head_dim]` per layer."""
        n = self._lens[i]
        if not n or not self.pool.keys:
            return None
        idx = torch.tensor(slots_of(self._blocks[i], n, self.pool.block_tokens),
                           dtype=torch.long, device=self.device)
        return tuple((k.index_select(1, idx).unsqueeze(0), v.index_select(1, idx).unsqueeze(0))
                     for k, v in zip(self.pool.keys, self.pool.values, strict=True))

    def decode_inputs(self, last_tokens: Sequence[int]) -> dict[str, Any]:
        """Inputs for one decode step: each row's last token at its next position."""
        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device).unsqueeze(1)
        mask = self._plan([1] * len(self.rows))
        return {"input_ids": ids, "attention_mask": mask,
                "position_ids": torch.tensor(self._lens, dtype=torch.long,
                                             device=self.device).unsqueeze(1),
                "past_key_values": self.cache}

    def chunk_inputs(self, chunks: Sequence[Sequence[int]], pad_id: int) -> dict[str, Any]:
        """Inputs appending a chunk per row, left-padded to the longest (a row may add none)."""
        width = max(len(c) for c in chunks)
        ids = [[pad_id] * (width - len(c)) + list(c) for c in chunks]
        pos = [[s] * (width - len(c)) + list(range(s, s + len(c)))
               for s, c in zip(self._lens, chunks, strict=True)]
        mask = self._plan([len(c) for c in chunks])
        return {"input_ids": torch.tensor(ids, dtype=torch.long, device=self.device),
                "attention_mask": mask,
                "position_ids": torch.tensor(pos, dtype=torch.long, device=self.device),
                "past_key_values": self.cache}

    def advance(self, inputs: dict[str, Any]) -> None:
        """After the forward pass that consumed the step's inputs: the new tokens are the rows'."""
        self._lens = [n + c for n, c in zip(self._lens, self._chunk, strict=True)]
        self._chunk, self._write = [], None

    def _plan(self, chunk: list[int]) -> torch.Tensor:
        """Allocate the step's blocks, compute the slots its KV goes to, and return its 4D mask
        `[rows, 1, new, width]`: a query at token `t` of its row sees columns `<= t`; a padding
        query (left of a shorter chunk) sees column 0 only, so no softmax row is empty."""
        for i, c in enumerate(chunk):
            self._blocks_for(i, self._lens[i] + c)
        if self._table is None:
            blocks = max((len(b) for b in self._blocks), default=0) or 1
            self._table = torch.tensor([b + [SCRATCH] * (blocks - len(b)) for b in self._blocks],
                                       dtype=torch.long, device=self.device)
        bt = self.pool.block_tokens
        new = max(chunk)
        lens = torch.tensor(self._lens, dtype=torch.long, device=self.device).unsqueeze(1)
        adds = torch.tensor(chunk, dtype=torch.long, device=self.device).unsqueeze(1)
        # the token each query is: the chunk is right-aligned (left-padded) in the step's input
        tok = lens + torch.arange(new, dtype=torch.long, device=self.device) - (new - adds)
        real = tok >= lens
        tok = torch.where(real, tok, 0)
        slots = self._table.gather(1, tok // bt) * bt + tok % bt
        self._write = torch.where(real, slots, SCRATCH).reshape(-1)
        self._flat = None
        self._chunk = chunk
        self.width = int(self._table.shape[1]) * bt
        cols = torch.arange(self.width, dtype=torch.long, device=self.device)
        allowed = (cols <= tok.unsqueeze(2)).unsqueeze(1)
        if self.mask_dtype is None:
            return allowed
        zero = torch.zeros((), dtype=self.mask_dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self.mask_dtype).min)

    def attend(self, j: int, key_states: torch.Tensor,
               value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `j` of the step: store the new KV, return the rows' blocks for attention."""
        if self._write is None or self._table is None:
            raise RuntimeError("a forward pass over a PagedBatch needs decode_inputs() or "
                               "chunk_inputs() first")
        rows, heads, _, dim = key_states.shape
        keys, values = self.pool.layer(j, key_states)
        keys.index_copy_(1, self._write, key_states.transpose(0, 1).reshape(heads, -1, dim))
        values.index_copy_(1, self._write, value_states.transpose(0, 1).reshape(heads, -1, dim))
        bt = self.pool.block_tokens
        if self._flat is None:  # block b of head h is row h * capacity + b of the 2D view
            per_head = torch.arange(heads, dtype=torch.long, device=self.device).unsqueeze(1)
            self._flat = (per_head * self.pool.capacity + self._table.reshape(1, -1)).reshape(-1)
        n = int(self._flat.shape[0])
        out = []
        for k, store in enumerate((keys, values)):
            if len(self._bufs) <= k or self._bufs[k].numel() < n * bt * dim \
                    or self._bufs[k].dtype != store.dtype:
                buf = store.new_empty(n * bt * dim)
                self._bufs[k:k + 1] = [buf]
            gathered = self._bufs[k][:n * bt * dim].view(n, bt * dim)
            torch.index_select(store.view(-1, bt * dim), 0, self._flat, out=gathered)
            out.append(gathered.view(heads, rows, self.width, dim).transpose(0, 1))
        return out[0], out[1]
