"""A bounded LRU cache of prompt KV, keyed by token-id sequences (prompt-prefix reuse).

What is stored: for a token sequence `key`, the model's key/value states of exactly those tokens
for one sequence, as the generator hands them over: a tuple with one `(keys, values)` pair per
layer, each tensor `[1, kv_heads, len(key), head_dim]`, contiguous, unpadded, on the model's
device and in its dtype (a private copy: the running batch never writes into it). Because
attention is causal, the first `m` positions of an entry are valid KV for *any* sequence that
starts with `key[:m]`, so a lookup returns the longest common prefix between the prompt and any
entry, not only whole entries (a shared system prompt hits even when the rest differs).

The generator stores a sequence's KV twice in its life: when its prompt is prefilled (so
concurrent requests sharing a system prompt reuse it) and when it retires (prompt + output but the
last token, whose KV was never computed, so a chat's next turn reuses the whole conversation). An
entry whose key is a prefix of a newer one is dropped as redundant; the cache is bounded by the
total number of tokens it holds (`capacity_tokens`) and evicts least recently used entries.

The cache is not thread-safe: only the generator's worker thread touches it. It knows nothing of
torch (values are opaque), so it is tested without a model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

V = TypeVar("V")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix (binary search over C-level slice compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class Hit(Generic[V]):
    tokens: int  # how many leading prompt tokens `value` covers (use value[..., :tokens, :])
    value: V


class PrefixCache(Generic[V]):
    def __init__(self, capacity_tokens: int, min_tokens: int = 1) -> None:
        self.capacity_tokens = max(0, capacity_tokens)
        self.min_tokens = max(1, min_tokens)
        self._entries: OrderedDict[tuple[int, ...], V] = OrderedDict()
        self.tokens_cached = 0
        self.hits = 0
        self.misses = 0
        self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int], max_tokens: int | None = None) -> Hit[V] | None:
        """The entry sharing the longest prefix with `prompt` (at most `max_tokens` of it)."""
        best_key: tuple[int, ...] | None = None
        best = 0
        prompt_t = tuple(prompt)
        limit = len(prompt_t) if max_tokens is None else min(max_tokens, len(prompt_t))
        if self._entries and limit >= self.min_tokens:
            for key in self._entries:
                if key[0] != prompt_t[0] or len(key) <= best:
                    continue
                n = min(common_prefix(key, prompt_t), limit)
                if n > best:
                    best, best_key = n, key
                    if best == limit:
                        break
        if best_key is None or best < self.min_tokens:
            self.misses += 1
            return None
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.tokens_reused += best
        return Hit(best, self._entries[best_key])

    def insert(self, tokens: Sequence[int], value: V) -> bool:
        """Store `value` as the KV of `tokens`; False when it was not stored (too short or long,
        or already covered by an entry that extends it)."""
        key = tuple(tokens)
        if not self.min_tokens <= len(key) <= self.capacity_tokens:
            return False
        for other in list(self._entries):
            if len(other) >= len(key) and other[:len(key)] == key:
                self._entries.move_to_end(other)  # already covered: refresh it
                return False
            if len(other) < len(key) and key[:len(other)] == other:
                self._drop(other)  # the new entry extends it
        self._entries[key] = value
        self.tokens_cached += len(key)
        while self.tokens_cached > self.capacity_tokens:
            self._drop(next(iter(self._entries)))
        return True

    def clear(self) -> None:
        self._entries.clear()
        self.tokens_cached = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        del self._entries[key]
        self.tokens_cached -= len(key)

    def stats(self) -> dict[str, Any]:
        lookups = self.hits + self.misses
        return {
            "hits": self.hits, "misses": self.misses,
            "hit_rate": self.hits / lookups if lookups else 0.0,
            "entries": len(self._entries), "tokens_cached": self.tokens_cached,
            "capacity_tokens": self.capacity_tokens, "tokens_reused": self.tokens_reused,
        }
