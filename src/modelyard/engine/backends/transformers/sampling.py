"""Per-row sampling over a batch of logits: every row has its own `SamplingParams`.

Penalties (stateful, per row) run first, then a constrained row's grammar mask (tokens it does
not admit get -inf; logprobs stay the raw distribution's), then greedy rows take the argmax and
sampled rows go through temperature, top-k, top-p and min-p, vectorised over the rows that
sample. Each row draws from its own `torch.Generator` seeded from `params.seed` (or at random),
so a seeded request samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from modelyard.engine.backends.transformers.params import SamplingParams

NEG_INF = float("-inf")


@dataclass
class Choice:
    token: int
    logprob: float | None = None  # of the raw distribution, when asked
    top: list[tuple[int, float]] | None = None


class TokenMask(Protocol):
    """A grammar a row's output must follow (constraints.py): which tokens it admits next, and
    the token taken."""

    def allowed(self, vocab: int, device: torch.device) -> torch.Tensor: ...

    def advance(self, token: int) -> None: ...

    @property
    def finished(self) -> bool: ...


class RowSampler:
    """One sequence's sampling state: its generator, the counts its penalties need and its
    grammar, if constrained."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int],
                 constraint: TokenMask | None = None) -> None:
        self.params = params
        self.constraint = constraint
        self._prompt = list(prompt_ids) if params.repetition_penalty != 1.0 else []
        self._generated: list[int] = []
        self._seen: torch.Tensor | None = None  # bool [V]: in prompt or output (repetition)
        self._counts: torch.Tensor | None = None  # float [V]: times generated (presence/freq)
        self._generator: torch.Generator | None = None

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(seed)
        return self._generator

    def observe(self, token: int) -> None:
        if self.constraint is not None:
            self.constraint.advance(token)
        if not self.params.penalized:
            return
        if self._seen is not None:
            self._seen[token] = True
        if self._counts is not None:
            self._counts[token] += 1
        else:
            self._generated.append(token)

    def penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """Apply this row's penalties to its logits row `[V]` (returns a new tensor)."""
        p = self.params
        vocab = logits.shape[-1]
        if self._counts is None:  # first step: build the state now that the vocabulary is known
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            self._counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
            ids = [t for t in self._prompt + self._generated if 0 <= t < vocab]
            if ids:
                self._seen[torch.tensor(ids, device=logits.device)] = True
            for t in self._generated:
                if 0 <= t < vocab:
                    self._counts[t] += 1
            self._prompt, self._generated = [], []
        assert self._seen is not None
        out = logits
        if p.repetition_penalty != 1.0:
            penalized = torch.where(out > 0, out / p.repetition_penalty,
                                    out * p.repetition_penalty)
            out = torch.where(self._seen, penalized, out)
        if p.frequency_penalty or p.presence_penalty:
            out = out - p.frequency_penalty * self._counts \
                - p.presence_penalty * (self._counts > 0).to(out.dtype)
        return out


def sample(logits: torch.Tensor, rows: Sequence[RowSampler]) -> list[Choice]:
    """Pick one token per row of `logits` `[B, V]`."""
    logits = logits.float()
    n = logits.shape[0]
    logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None
    if any(r.params.penalized for r in rows):
        logits = torch.stack([r.penalize(logits[i]) if r.params.penalized else logits[i]
                              for i, r in enumerate(rows)])
    constrained = [i for i, r in enumerate(rows) if r.constraint is not None]
    if constrained:  # after the raw logprobs: those stay the model's own distribution
        vocab = logits.shape[-1]
        allowed = torch.stack([c.allowed(vocab, logits.device) for c in
                               (rows[i].constraint for i in constrained) if c is not None])
        logits = logits.clone()
        logits[constrained] = logits[constrained].masked_fill(~allowed, NEG_INF)
    tokens = [0] * n
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        picked = logits[greedy].argmax(dim=-1).tolist()
        for i, t in zip(greedy, picked, strict=True):
            tokens[i] = int(t)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        probs = _probabilities(logits[sampled], [rows[i].params for i in sampled])
        for j, i in enumerate(sampled):
            gen = rows[i].generator(probs.device)
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=gen))
    choices = [Choice(t) for t in tokens]
    if raw is not None:
        for j, i in enumerate(logprob_rows):
            choice = choices[i]
            choice.logprob = float(raw[j, choice.token])
            top_n = rows[i].params.logprobs or 0
            if top_n:
                values, ids = raw[j].topk(min(top_n, raw.shape[-1]))
                choice.top = list(zip(ids.tolist(), values.tolist(), strict=True))
            else:
                choice.top = []
    for r, c in zip(rows, choices, strict=True):
        r.observe(c.token)
    return choices


def _probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p for rows that sample; returns probabilities `[b, V]`."""
    device = logits.device
    vocab = logits.shape[-1]
    temps = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    x = logits / temps
    if any(p.top_k > 0 for p in params):
        ks = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params],
                          device=device)
        kth = x.sort(dim=-1, descending=True).values.gather(1, (ks - 1).unsqueeze(1))
        x = x.masked_fill(x < kth, NEG_INF)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
        sorted_x, order = x.sort(dim=-1, descending=True)
        sorted_p = sorted_x.softmax(dim=-1)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the strictly more likely tokens
        drop_sorted = before >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        x = x.masked_fill(drop, NEG_INF)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * min_p, NEG_INF)
    return x.softmax(dim=-1)
