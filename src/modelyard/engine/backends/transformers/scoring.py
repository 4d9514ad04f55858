"""Prompt scoring on the transformers engine's /v1/completions: `echo` with an integer `logprobs`
gives every token of the prompt its log probability (the first `null`) and its `logprobs`
likeliest alternatives, in OpenAI's completions shape (modelyard.completion_logprobs), then the
generated tokens' (when `max_tokens` > 0). What lm-evaluation-harness's `local-completions`
sends for log-likelihood tasks; the front passes such a request on unchanged
(front/chat/scoring.py), as it does to vLLM.

One forward pass over the prompt gives every position's distribution at once; it runs on the
generator's worker thread between two steps (BatchGenerator.run), the one thread that may run
the model. The distribution is the model's raw one, as for generated tokens (params.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from modelyard.completion_logprobs import added_bos, completions_logprobs
from modelyard.engine.backends.transformers.params import ContextOverflow, SamplingParams

if TYPE_CHECKING:
    from modelyard.engine.backends.transformers.generator import BatchGenerator

Entry = dict[str, Any]
TokenText = Callable[[int], tuple[str, list[int]]]


def scored_alternatives(body: dict[str, Any], chat: bool) -> int | None:
    """`logprobs` when a completions body scores its prompt (`echo` and an integer)."""
    k = body.get("logprobs")
    if chat or body.get("echo") is not True or not isinstance(k, int) or isinstance(k, bool):
        return None
    return k


def prompt_entries(model: Any, ids: list[int], k: int, token_text: TokenText) -> list[Entry | None]:
    """Each token's entry after the tokens before it (None for the first): one forward pass.
    Call it where the model may run (BatchGenerator.run)."""
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0]
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    targets = torch.tensor(ids[1:], device=device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    best = torch.topk(logprobs, max(1, k), dim=-1)
    top_ids, top_values = best.indices.tolist(), best.values.tolist()
    entries: list[Entry | None] = [None]
    for token, logprob, alt_ids, alt_values in zip(ids[1:], chosen, top_ids, top_values,
                                                   strict=True):
        text, raw = token_text(token)
        entries.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": [
            {"token": token_text(a)[0], "logprob": v} for a, v in zip(alt_ids, alt_values,
                                                                     strict=True)]})
    return entries


async def answer(generator: BatchGenerator, body: dict[str, Any], k: int, model_name: str,
                 prompt_ids: Callable[[dict[str, Any]], list[int]], token_text: TokenText,
                 whole: Callable[[Any], Any]) -> dict[str, Any]:  # fmt: skip
    """The answer to a scoring request: `prompt_ids` tokenizes `{"prompt": p}`; `whole(events)`
    reads a generation (server.Completion.whole). Raises ValueError for a bad prompt,
    ContextOverflow, InvalidParams."""
    prompts = _prompts(body.get("prompt"))
    max_tokens = body.get("max_tokens")
    params = SamplingParams.from_openai(body) if max_tokens != 0 else None
    choices, prompt_n, completion_n = [], 0, 0
    for index, prompt in enumerate(prompts):
        ids = prompt_ids({"prompt": prompt})
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        if len(ids) > generator.context_length:
            raise ContextOverflow(len(ids), generator.context_length)
        scored = await generator.run(lambda ids=ids: prompt_entries(  # type: ignore[misc]
            generator.model, ids, k, token_text))
        pieces = [bytes(token_text(t)[1]) for t in ids]
        generated: list[Entry] = []
        text, finish, made = "", "length", 0
        if params is not None:
            done = await whole(generator.generate(ids, params))
            choice = done["choices"][0]
            text, finish = str(choice.get("text") or ""), choice.get("finish_reason")
            generated = (choice.get("logprobs") or {}).get("content") or []
            made = int(done["usage"]["completion_tokens"])
        lead = int(isinstance(prompt, str) and added_bos(prompt, pieces))
        echoed = prompt if isinstance(prompt, str) else b"".join(pieces).decode("utf-8", "replace")
        choices.append({"index": index, "text": echoed + text, "finish_reason": finish,
                        "logprobs": completions_logprobs(pieces[lead:], scored[lead:], generated,
                                                         k)})
        prompt_n += len(ids)
        completion_n += made
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_n, "completion_tokens": completion_n,
                      "total_tokens": prompt_n + completion_n}}


def _prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) for t in prompt)):  # fmt: skip
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return list(prompt)
    raise ValueError("`prompt` must be a string, strings, token ids or lists of token ids")
