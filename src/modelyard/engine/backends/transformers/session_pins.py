"""Session-pinned KV: one conversation's KV kept apart from the ordinary prefix cache.

Why: the prefix cache (`prefix_cache.py`) is one LRU for all traffic. When many agents interleave,
a conversation's KV is evicted by everyone else's prompts before its next turn arrives, and the
whole conversation is prefilled again. Requests that belong to a server-side chat session carry
an opaque session key (`x_modelyard_session`); when such a sequence retires, its KV (prompt +
output but the last token, the same thing the prefix cache stores) becomes that session's *pin*.

- One pin per session: a new turn replaces the previous one (it normally extends it).
- A total token budget (`capacity_tokens`) across sessions; over it, whole sessions are evicted,
  least recently used first (a lookup or a new turn makes a session recent). A pin longer than the
  budget is not stored and leaves the session's previous pin in place (it still covers the start
  of the conversation).
- Only session traffic touches this structure, so ordinary requests cannot evict a pin.
- A lookup only consults the asking session's own pin and returns its longest common prefix with
  the prompt (the semantics of `PrefixCache.lookup`: by causality the first `m` positions of a
  pin are valid KV for any prompt starting with the same `m` tokens). The generator takes the
  longer of this hit and the ordinary cache's.

Values are opaque (the generator stores the very tuple it hands the prefix cache, so a pin and
a prefix-cache entry of the same retirement share their tensors). Like `PrefixCache`, it is not
thread-safe: only the generator's worker thread touches it; it is tested without torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from modelyard.engine.backends.transformers.prefix_cache import Hit, common_prefix

V = TypeVar("V")

MAX_KEY_CHARS = 128


class SessionPins(Generic[V]):
    def __init__(self, capacity_tokens: int, min_tokens: int = 1) -> None:
        self.capacity_tokens = max(0, capacity_tokens)
        self.min_tokens = max(1, min_tokens)
        # session key -> (tokens the value covers, value), least recently used first
        self._pins: OrderedDict[str, tuple[tuple[int, ...], V]] = OrderedDict()
        self.tokens_cached = 0
        self.hits = 0
        self.misses = 0
        self.tokens_reused = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, session: object) -> bool:
        return session in self._pins

    def tokens_of(self, session: str) -> tuple[int, ...] | None:
        pin = self._pins.get(session)
        return pin[0] if pin is not None else None

    def lookup(self, session: str, prompt: Sequence[int],
               max_tokens: int | None = None) -> Hit[V] | None:
        """The session's pin as far as it matches `prompt` (at most `max_tokens` of it)."""
        pin = self._pins.get(session)
        prompt_t = tuple(prompt)
        limit = len(prompt_t) if max_tokens is None else min(max_tokens, len(prompt_t))
        n = min(common_prefix(pin[0], prompt_t), limit) if pin is not None else 0
        if pin is None or n < self.min_tokens:
            self.misses += 1
            return None
        self._pins.move_to_end(session)
        self.hits += 1
        self.tokens_reused += n
        return Hit(n, pin[1])

    def insert(self, session: str, tokens: Sequence[int], value: V) -> bool:
        """Make `value` (the KV of `tokens`) the session's pin, replacing its previous one; False
        when it was not stored (too short, or longer than the whole budget)."""
        key = tuple(tokens)
        if not self.min_tokens <= len(key) <= self.capacity_tokens:
            return False
        self.drop(session)
        self._pins[session] = (key, value)
        self.tokens_cached += len(key)
        while self.tokens_cached > self.capacity_tokens:
            oldest = next(iter(self._pins))  # never the new pin: it alone fits the budget
            self.drop(oldest)
            self.evictions += 1
        return True

    def drop(self, session: str) -> bool:
        """Forget the session's pin; False when it had none."""
        pin = self._pins.pop(session, None)
        if pin is None:
            return False
        self.tokens_cached -= len(pin[0])
        return True

    def clear(self) -> None:
        self._pins.clear()
        self.tokens_cached = 0

    def stats(self) -> dict[str, Any]:
        lookups = self.hits + self.misses
        return {
            "hits": self.hits, "misses": self.misses,
            "hit_rate": self.hits / lookups if lookups else 0.0,
            "sessions": len(self._pins), "tokens_cached": self.tokens_cached,
            "capacity_tokens": self.capacity_tokens, "tokens_reused": self.tokens_reused,
            "evictions": self.evictions,
        }


def valid_session_key(value: object) -> str | None:
    """Why `value` is not a usable session key, or None when it is."""
    if not isinstance(value, str):
        return "x_modelyard_session must be a string"
    if not value:
        return "x_modelyard_session must not be empty"
    if len(value) > MAX_KEY_CHARS:
        return f"x_modelyard_session must be at most {MAX_KEY_CHARS} characters"
    return None
