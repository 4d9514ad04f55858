"""Sampling parameters of one request: validated, immutable, torch-free.

`SamplingParams.from_openai(body)` reads an OpenAI chat/completions body and raises
`InvalidParams` (a `ValueError` naming the offending field in `.param`) for values the generator
cannot honour, so the HTTP layer can answer 400 before anything is queued.

Conventions (the OpenAI ones unless noted):

* `temperature == 0` means greedy (argmax); greedy output equals `model.generate(do_sample=False)`.
* `top_k == 0` disables top-k (vLLM uses -1 for that; -1 is rejected here), `top_p == 1` and
  `min_p == 0` disable theirs. Order of application: penalties, temperature, top-k, top-p, min-p.
* `repetition_penalty` is the HF/CTRL one (divide positive logits, multiply negative ones, for every
  token already in the prompt or the output); `presence_penalty`/`frequency_penalty` are OpenAI's
  (subtracted from the logits of tokens already *generated*).
* `logprobs`: `None` = no logprobs; `N >= 0` = the chosen token's logprob plus the top N
  alternatives. Chat bodies spell it `logprobs: true, top_logprobs: N`; legacy completions bodies
  `logprobs: N`. Logprobs are those of the model's raw distribution (before penalties and
  temperature), like OpenAI's.
* `max_tokens` (or chat's newer `max_completion_tokens`) `None` = up to the model's context.
* `n` (choices) is not a sampling field: `choices_of(body)` reads it; each choice is a sequence
  of its own (the server's), its seed the request's plus the choice's index (as llama-server).
* `ignore_eos` (vLLM's and llama-server's extension) keeps generating past EOS tokens, for
  benchmarks that need a fixed number of tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_STOP = 4
MAX_LOGPROBS = 20
MAX_CHOICES = 128  # the front bounds `n` by its `max_choices` setting (at most this)


class InvalidParams(ValueError):
    """A sampling parameter the generator cannot honour; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class ContextOverflow(InvalidParams):
    """A prompt that leaves no room in the model's context. The server answers it in
    llama-server's shape (`exceed_context_size_error` with the counts), which the front turns
    into each API's own (front/chat/openai_compat.py), as it does llama-server's."""

    def __init__(self, n_prompt: int, n_ctx: int) -> None:
        super().__init__(f"the prompt has {n_prompt} tokens; the model's context is {n_ctx}",
                         "prompt")
        self.n_prompt = n_prompt
        self.n_ctx = n_ctx

    def llama_server_body(self) -> dict[str, object]:
        return {"error": {
            "code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": self.n_prompt,
            "n_ctx": self.n_ctx, "message": f"request ({self.n_prompt} tokens) exceeds the "
                                           f"available context size ({self.n_ctx} tokens)"}}


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    ignore_eos: bool = False  # vLLM/llama-server extension: run to max_tokens (benchmarks)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def validate(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidParams(f"max_tokens must be at least 1, got {self.max_tokens}",
                                "max_tokens")
        if not self.temperature >= 0.0 or math.isinf(self.temperature):
            raise InvalidParams(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParams(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise InvalidParams(f"top_k must be >= 0 (0 disables it), got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParams(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidParams("repetition_penalty must be in (0, 10], got "
                                f"{self.repetition_penalty}", "repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidParams(f"{name} must be in [-2, 2], got {value}", name)
        if len(self.stop) > MAX_STOP:
            raise InvalidParams(f"at most {MAX_STOP} stop sequences, got {len(self.stop)}", "stop")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParams("stop sequences must be non-empty strings", "stop")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidParams(f"top logprobs must be in [0, {MAX_LOGPROBS}], got "
                                f"{self.logprobs}", "top_logprobs")

    @classmethod
    def from_openai(cls, body: Mapping[str, Any]) -> SamplingParams:
        """The sampling fields of an OpenAI chat or completions request body."""
        max_tokens = _int(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens")
        seed = _int(body, "seed")
        return cls(
            max_tokens=max_tokens,
            temperature=_float(body, "temperature", 1.0),
            top_p=_float(body, "top_p", 1.0),
            top_k=_int(body, "top_k") or 0,
            min_p=_float(body, "min_p", 0.0),
            seed=None if seed is None else seed & 0xFFFF_FFFF_FFFF_FFFF,
            stop=_stop(body.get("stop")),
            repetition_penalty=_float(body, "repetition_penalty", 1.0),
            presence_penalty=_float(body, "presence_penalty", 0.0),
            frequency_penalty=_float(body, "frequency_penalty", 0.0),
            logprobs=_logprobs(body),
            ignore_eos=_bool(body, "ignore_eos"),
        )


def choices_of(body: Mapping[str, Any]) -> int:
    """A request's `n`: how many choices to generate from its prompt."""
    n = _int(body, "n")
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise InvalidParams(f"n must be in [1, {MAX_CHOICES}], got {n}", "n")
    return 1 if n is None else n


def _int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise InvalidParams(f"{key} must be an integer, got {value!r}", key)
    return value


def _float(body: Mapping[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidParams(f"{key} must be a number, got {value!r}", key)
    result = float(value)
    if math.isnan(result):
        raise InvalidParams(f"{key} must be a number, got NaN", key)
    return result


def _bool(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidParams(f"{key} must be a boolean, got {value!r}", key)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list | tuple) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise InvalidParams("stop must be a string or a list of strings", "stop")


def _logprobs(body: Mapping[str, Any]) -> int | None:
    value = body.get("logprobs")
    top = body.get("top_logprobs")
    if isinstance(value, bool) or value is None:  # chat: logprobs: bool, top_logprobs: int
        top_n = _int(body, "top_logprobs")
        if not value:
            if top_n:
                raise InvalidParams("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        if top_n is not None and not 0 <= top_n <= MAX_LOGPROBS:
            raise InvalidParams(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}",
                                "top_logprobs")
        return top_n or 0
    legacy = _int(body, "logprobs")  # completions: logprobs: int
    if legacy is None or not 0 <= legacy <= MAX_LOGPROBS:
        raise InvalidParams(f"logprobs must be in [0, {MAX_LOGPROBS}], got {value!r}", "logprobs")
    return legacy
