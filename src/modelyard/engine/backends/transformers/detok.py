"""Incremental detokenization and stop strings, for streaming.

Decoding each new token on its own loses spaces (SentencePiece drops a word's leading "▁" when it
starts a decode) and breaks characters whose UTF-8 bytes span several tokens (byte-level BPE and
byte-fallback tokens such as `<0xE6>`). `IncrementalDetokenizer` uses the prefix/read-offset
technique of vLLM and TGI: it re-decodes a short window `ids[prefix_offset:]`, emits only what the
window added past `ids[prefix_offset:read_offset]`, and holds everything back while the decoded
text ends in U+FFFD (an incomplete character). The window starts with the prompt's last tokens, so
the first generated word keeps its leading space. `finish()` flushes what is held (a stream that
ends in the middle of a character ends in U+FFFD, exactly as a one-shot decode would).

`StopMatcher` matches stop strings on the text, across token boundaries: it holds back the tail
that could still become a stop string and, on a match, cuts the text before it (the stop string
itself is never emitted).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

PROMPT_CONTEXT = 5  # prompt tokens in the first decode window (as vLLM's initial offset)
REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        if context and self._decode(context).endswith(REPLACEMENT):
            context = []  # the prompt ends inside a character: the output stands on its own
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=self._skip))

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes ("" while held back)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._ids[self._prefix_offset:])
        if len(text) > len(prefix) and not text.endswith(REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return text[len(prefix):]
        return ""

    def finish(self) -> str:
        """What is still held back (an unfinished character decodes to U+FFFD, as in a full
        decode)."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix):] if len(text) > len(prefix) else ""


class StopMatcher:
    """Feeds decoded text through; returns what is safe to emit and whether a stop string hit."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""  # text received but not yet emitted (could start a stop string)
        self.stopped = False
        self.matched: str | None = None  # the stop string that hit (the answer's stop_reason)

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self._stops:
            return text
        held = self._held + text
        hits = [(i, s) for s in self._stops if (i := held.find(s)) >= 0]
        if hits:
            cut, self.matched = min(hits, key=lambda hit: hit[0])
            self.stopped = True
            self._held = ""
            return held[:cut]
        keep = self._partial_suffix(held)
        self._held = held[len(held) - keep:] if keep else ""
        return held[:len(held) - keep]

    def flush(self) -> str:
        """At the end of the stream: the held tail was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for n in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed (printable stand-in character -> byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenText:
    """A token's display text and raw bytes, for logprobs entries (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        text = str(self._tokenizer.decode([token_id], skip_special_tokens=False))
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        raw: bytes | None = None
        if isinstance(piece, str):
            match = _BYTE_TOKEN.match(piece)
            decoder = _byte_decoder()
            if match:  # SentencePiece byte fallback
                raw = bytes([int(match.group(1), 16)])
            elif REPLACEMENT in text and piece and all(c in decoder for c in piece):
                raw = bytes(decoder[c] for c in piece)  # byte-level BPE, part of a character
        if raw is None:
            raw = text.encode("utf-8")
        return text, list(raw)
