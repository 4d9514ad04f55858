"""Prompt scoring on /v1/completions (issue 32): `echo` with an integer `logprobs` gives every
token of the prompt its log probability (the first one `null`: nothing comes before it) and its
`logprobs` most likely alternatives, in OpenAI's completions shape; `max_tokens: 0` generates
nothing. That is what lm-evaluation-harness's `local-completions` model sends for log-likelihood
tasks (token-id prompts, `max_tokens` 0 or 1): it sums `token_logprobs` over the continuation and
compares each token with the best of its `top_logprobs` (is it greedy?).

Who serves it, by backend:
- llama-server has no prompt log probabilities (its OpenAI route refuses `echo`), but with
  `n_probs` and `post_sampling_probs: false` its native `/completion` reports the probability of
  the token it sampled under the model's *raw* distribution, before the samplers, and the
  `logit_bias` sampler comes after: so prompt token t_i's log probability is one `/completion`
  of t_0..t_{i-1} (as ids) with `n_predict: 1` and a bias that makes t_i the token sampled.
  With `cache_prompt` each step evaluates one new token on the slot of the step before. This
  costs one step per prompt token, so a prompt is bounded (`max_scored_prompt_tokens`, else a
  400 `prompt_too_long_for_scoring`); all the steps (the prompt's `/tokenize` with pieces first,
  and the generation after, when `max_tokens` > 0) hold one lease (Relay.call).
- other OpenAI servers (vLLM) and the transformers engine answer `echo` and `logprobs`
  themselves: the request passes unchanged.

`max_tokens: 0` without scoring is answered here, without a backend: the text is the prompt
(with `echo`) or nothing, `finish_reason` "length".
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Receive

from modelyard.completion_logprobs import added_bos, completions_logprobs
from modelyard.config import LlamaCppModel, OpenAIServerModel
from modelyard.errors import (
    InvalidRequest,
    ModelyardError,
    PromptLogprobsUnsupported,
    PromptTooLongForScoring,
)
from modelyard.front.chat import openai_compat
from modelyard.front.chat.presets import apply_preset
from modelyard.front.chat.request import COMPLETION_PATH
from modelyard.front.dispatch.relay import ClientWatch, Relay
from modelyard.front.sse import sse_event
from modelyard.front.state import FrontState
from modelyard.metrics import note_usage, usage_of

# A bias no logit comes near: the token it is given is the one sampled, whatever the samplers.
FORCE_BIAS = 1e9
# The request fields that do not go to llama-server's generation of a scored prompt.
_NOT_UPSTREAM = ("echo", "stream", "stream_options", "prompt", "logprobs", "n")


def concerns(data: dict[str, Any]) -> bool:
    """Whether this /v1/completions body is served here (two lookups on the usual path)."""
    return data.get("max_tokens") == 0 or scored_alternatives(data) is not None


def scored_alternatives(data: dict[str, Any]) -> int | None:
    """`logprobs` when the request scores its prompt (`echo` and an integer `logprobs`)."""
    logprobs = data.get("logprobs")
    if data.get("echo") is not True or not isinstance(logprobs, int) or \
            isinstance(logprobs, bool):
        return None
    if not 0 <= logprobs <= 20:
        raise InvalidRequest("logprobs: must be between 0 and 20", param="logprobs")
    return logprobs


async def answer(receive: Receive, priority: int, state: FrontState, model: str,
                 data: dict[str, Any]) -> Response | None:  # fmt: skip
    """The answer to a request `concerns` took; None: its backend serves it as sent."""
    entry = state.catalog.registry.resolve(model)
    k = scored_alternatives(data)
    if k is None:  # max_tokens 0, nothing to score: nothing to ask a backend
        return _respond(_nothing(model, _prompts(data), echo=data.get("echo") is True), data)
    if isinstance(entry.spec, OpenAIServerModel):
        return None  # vLLM and its kind score prompts themselves
    if not isinstance(entry.spec, LlamaCppModel):
        # the transformers engine answers it whole (engine/backends/transformers/scoring.py)
        return None if entry.spec.backend == "transformers" else _unsupported(model)
    if data.get("n") not in (None, 1):
        raise InvalidRequest("n: a scored prompt has one answer; send n=1", param="n")
    prompts = _prompts(data)
    watch = ClientWatch(receive)  # a client that leaves stops the steps
    try:
        scored = await watch.wait(_on_llama_server(priority, state, model, data, prompts, k))
    except _Refused as refused:  # in OpenAI's shape where llama-server's differs, else as is
        shaped = openai_compat.openai_error(refused.status, refused.body, infill=False)
        status, body = shaped if shaped is not None else (refused.status, refused.body)
        return Response(body, status_code=status, media_type="application/json")
    finally:
        watch.stop()
    return _respond(scored, data)


def _unsupported(model: str) -> Response:
    raise PromptLogprobsUnsupported(
        f"model '{model}' cannot score a prompt (`echo` with `logprobs`) on its backend",
        param="echo", model=model)


def _prompts(data: dict[str, Any]) -> list[str | list[int]]:
    """The prompts, one per choice: a string, or token ids."""
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(_is_id(t) for t in p))
            for p in prompt):  # fmt: skip
        return list(prompt)
    raise InvalidRequest("prompt: a string, a list of strings, token ids or lists of token ids",
                         param="prompt")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _envelope(model: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, **extra}


def _nothing(model: str, prompts: list[str | list[int]], *, echo: bool) -> dict[str, Any]:
    """`max_tokens: 0`: no token generated, the prompt echoed when asked."""
    if echo and not all(isinstance(p, str) for p in prompts):
        raise InvalidRequest("echo: supported for text prompts only, not token ids, unless "
                             "`logprobs` is set too", param="echo")
    return _envelope(model, [
        {"index": i, "text": p if echo and isinstance(p, str) else "", "logprobs": None,
         "finish_reason": "length"} for i, p in enumerate(prompts)])


def _respond(answer: dict[str, Any], data: dict[str, Any]) -> Response:
    note_usage(usage_of(answer))  # the request's usage event: the steps' usage, as answered
    if data.get("stream") is not True:
        return Response(orjson.dumps(answer), media_type="application/json")
    # A stream of one chunk: everything is known before the first byte.
    usage = answer.pop("usage", None)
    options = data.get("stream_options")
    chunks = [sse_event(answer if usage is None else {**answer, "usage": None})]
    if usage is not None and isinstance(options, dict) and options.get("include_usage"):
        chunks.append(sse_event({**answer, "choices": [], "usage": usage}))
    return Response(b"".join(chunks) + b"data: [DONE]\n\n", media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"})


# ---- llama-server ------------------------------------------------------------------------------


class _Refused(Exception):
    """llama-server refused one of the steps: its status and body go to the client."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status, self.body = status, body


async def _on_llama_server(priority: int, state: FrontState, model: str, data: dict[str, Any],
                           prompts: list[str | list[int]], k: int) -> dict[str, Any]:  # fmt: skip
    relay = await state.dispatch.open_relay(
        model, "/tokenize", _tokenize_body(prompts[0]), priority=priority)
    try:
        choices, prompt_n, completion_n = [], 0, 0
        for index, prompt in enumerate(prompts):
            if index == 0:
                status, raw = relay.status, await relay.body()
            else:
                status, raw = await relay.call("/tokenize", _tokenize_body(prompt))
            ids, pieces = _tokens(_ok(status, raw, model))
            bound = state.catalog.settings.max_scored_prompt_tokens
            if len(ids) > bound:
                raise PromptTooLongForScoring(
                    f"prompt {index} has {len(ids)} tokens; scoring (`echo` with `logprobs`) "
                    f"takes at most max_scored_prompt_tokens={bound} on this model",
                    param="prompt", model=model)
            if not ids:
                raise InvalidRequest(f"prompt {index} is empty", param="prompt", model=model)
            scored = [None, *[await _step(relay, model, ids[:i], ids[i], k)
                              for i in range(1, len(ids))]]
            choice, generated = await _generate(relay, state, model, data, ids, k)
            choice["index"] = index
            choice["text"] = _text(prompt, pieces) + choice["text"]
            # A BOS the model puts before a text prompt is context, not the prompt's text.
            lead = int(isinstance(prompt, str) and added_bos(prompt, pieces))
            choice["logprobs"] = completions_logprobs(pieces[lead:], scored[lead:],
                                                      choice["logprobs"], k)
            choices.append(choice)
            prompt_n += len(ids)
            completion_n += generated
    finally:
        relay.close()
    return _envelope(model, choices, usage={
        "prompt_tokens": prompt_n, "completion_tokens": completion_n,
        "total_tokens": prompt_n + completion_n})


def _tokenize_body(prompt: str | list[int]) -> bytes:
    # A text prompt as llama-server's completion tokenizes it (special tokens parsed, BOS
    # added); ids as they are (it adds nothing to ids). `/tokenize` takes ids to give pieces.
    return orjson.dumps({"content": prompt, "add_special": isinstance(prompt, str),
                         "parse_special": True, "with_pieces": True})


def _ok(status: int, raw: bytes, model: str) -> Any:
    if status != 200:
        raise _Refused(status, raw)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ModelyardError(f"llama-server of '{model}': an answer that is not JSON",
                             model=model) from None


def _tokens(answer: Any) -> tuple[list[int], list[bytes]]:
    """Ids and the bytes of each token (a piece that is not whole UTF-8 comes as byte values)."""
    ids, pieces = [], []
    for token in answer.get("tokens") or [] if isinstance(answer, dict) else []:
        piece = token.get("piece", "")
        ids.append(int(token["id"]))
        pieces.append(piece.encode() if isinstance(piece, str) else bytes(piece))
    return ids, pieces


async def _step(relay: Relay, model: str, context: list[int], token: int,
                k: int) -> dict[str, Any]:  # fmt: skip
    """`token`'s log probability after `context`, and the `k` likeliest tokens there."""
    status, raw = await relay.call("/completion", orjson.dumps({
        "prompt": context, "n_predict": 1, "n_probs": max(1, k), "post_sampling_probs": False,
        "temperature": 0, "logit_bias": [[token, FORCE_BIAS]], "cache_prompt": True}))
    probs = _ok(status, raw, model).get("completion_probabilities") or []
    if not probs or probs[0].get("id") != token:
        raise ModelyardError(f"llama-server of '{model}' did not score token {token}",
                             model=model)
    return dict(probs[0])


async def _generate(relay: Relay, state: FrontState, model: str, data: dict[str, Any],
                    ids: list[int], k: int) -> tuple[dict[str, Any], int]:  # fmt: skip
    """The generated part of the choice (`max_tokens` > 0) after the prompt's ids, with its
    tokens' log probabilities (chat-shaped, as llama-server's OpenAI route gives them), and
    how many tokens it has."""
    if not data.get("max_tokens"):
        return {"text": "", "logprobs": [], "finish_reason": "length"}, 0
    body = {key: value for key, value in data.items() if key not in _NOT_UPSTREAM}
    entry = state.catalog.registry.get(model)
    if entry is not None and entry.preset is not None:
        body = apply_preset(entry.preset, body)
    body.update(prompt=ids, logprobs=max(1, k), stream=False)
    answer = _ok(*await relay.call(COMPLETION_PATH, orjson.dumps(body)), model)
    choice = (answer.get("choices") or [{}])[0]
    content = (choice.get("logprobs") or {}).get("content") or []
    usage = answer.get("usage") or {}
    return ({"text": str(choice.get("text") or ""), "logprobs": content,
             "finish_reason": choice.get("finish_reason")},
            int(usage.get("completion_tokens") or len(content)))


def _text(prompt: str | list[int], pieces: list[bytes]) -> str:
    return prompt if isinstance(prompt, str) else b"".join(pieces).decode("utf-8", "replace")
