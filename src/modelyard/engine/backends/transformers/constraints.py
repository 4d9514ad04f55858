"""Constrained decoding through llguidance: one matcher per sequence, its mask applied to that
row's logits inside the continuous batch (sampling.py), advanced with the token sampled.

Why llguidance (over xgrammar and outlines-core): its matcher needs no torch (the mask is a plain
bitmask we apply ourselves), it computes masks fast enough per token with no grammar
precompilation step per vocabulary, it compiles JSON schemas and Lark grammars (with `%json`
embedded, which the forced tool calls need), and it is maintained by guidance-ai and used by
llama.cpp and vLLM.

`Compiler` wraps the model's tokenizer for llguidance once (about a second for a 50k
vocabulary, so lazily, on the first constrained request) and turns a request into a
`Constraint`, raising `InvalidGrammar` (→ 400) for a grammar llguidance refuses. A sequence
ends when its matcher is stopped: after EOS (allowed only where the grammar accepts) or as soon
as the grammar admits nothing more.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer
from llguidance.hf import from_tokenizer

from modelyard.engine.backends.transformers.grammars import (
    Grammar,
    InvalidGrammar,
    request_grammar,
)
from modelyard.engine.backends.transformers.tool_calls import Family

log = logging.getLogger(__name__)


class Constraint:
    """One sequence's matcher (used by the generator's worker thread only)."""

    def __init__(self, matcher: LLMatcher, eos: int) -> None:
        self._matcher = matcher
        self._eos = eos

    def allowed(self, vocab: int, device: torch.device) -> torch.Tensor:
        """Bool `[vocab]`: the tokens the grammar admits next (EOS only where it accepts)."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:vocab].astype(bool)
        if allowed.shape[0] < vocab:  # the model's logits outnumber the tokenizer's words
            allowed = np.concatenate([allowed, np.zeros(vocab - allowed.shape[0], dtype=bool)])
        if not allowed.any():  # a matcher in error: let the sequence end rather than fail
            allowed[self._eos] = True
        return torch.from_numpy(allowed).to(device)

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            log.warning("constrained sequence left its grammar: %s", self._matcher.get_error())

    @property
    def finished(self) -> bool:
        """The grammar admits no more tokens (it took EOS, completed, or failed)."""
        return bool(self._matcher.is_stopped())


class Compiler:
    def __init__(self, tokenizer: Any, eos: Iterable[int], vocab_size: int | None = None) -> None:
        self._hf = tokenizer
        self._eos = sorted(eos) or [int(tokenizer.eos_token_id)]
        self._vocab = vocab_size
        self._ll: LLTokenizer | None = None
        self._lock = threading.Lock()

    def tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._ll is None:
                n_vocab = max(len(self._hf), self._vocab or 0)
                self._ll = from_tokenizer(self._hf, n_vocab=n_vocab, eos_token=self._eos)
            return self._ll

    def for_request(self, body: dict[str, Any], chat: bool,
                    family: Family | None) -> Constraint | None:
        """The constraint `body` asks for (None when none); blocking: call it in a thread."""
        grammar = request_grammar(body, chat, family)
        return None if grammar is None else self.compile(grammar)

    def compile(self, grammar: Grammar) -> Constraint:
        try:
            ll = self.tokenizer()
        except ValueError as exc:  # e.g. a slow (Python) tokenizer, which llguidance cannot read
            raise InvalidGrammar(f"this model cannot constrain its output: {exc}",
                                 grammar.param, "unsupported_constraint") from exc
        try:
            lark = LLMatcher.grammar_from_lark(grammar.lark)
        except ValueError as exc:
            raise InvalidGrammar(str(exc), grammar.param, grammar.code) from exc
        matcher = LLMatcher(ll, lark, log_level=0)
        if matcher.is_error():
            raise InvalidGrammar(f"cannot enforce this {grammar.param}: "
                                 f"{matcher.get_error()}", grammar.param, grammar.code)
        return Constraint(matcher, self._eos[0])
