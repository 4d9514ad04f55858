"""Ollama's answer to a prompt longer than the context: it is cut to fit, not refused.

As Ollama does: /api/chat keeps the system message(s) and the latest message and drops the
oldest turns, whole messages, until the prompt fits; /api/generate keeps the end of its prompt
(and its first NUM_KEEP tokens, Ollama's default `num_keep`). Only a chat whose system
message(s) and last message alone are longer than the context is refused: the backend's 400,
with the counts, in Ollama's shape (front/chat/render.py).

The counting is the backend's own, as for the overflow error it already reports: the request
goes up unchanged, and only when llama-server (or the transformers engine, which speaks the
same shape) answers `exceed_context_size_error` with the prompt's tokens and the context is it
cut and sent again. A prompt that fits costs nothing more. The cut is estimated from those two
counts, each message (or the prompt's text) weighing by its length; when the estimate falls
short the next refusal says by how much, and each retry drops at least one more message (or a
tenth of the text), so it ends. The context is the one the request is served with (its
`num_ctx` rounded up to a power of two, at least the model's own: front/chat/context.py).

A cut prompt leaves room for the answer: `num_predict` tokens when it says fewer, else a
quarter of the context (llama-server stops an answer at the end of the context; Ollama would
shift it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson

from modelyard.front.chat.openai_compat import context_overflow

if TYPE_CHECKING:
    from modelyard.front.chat.request import ChatCall
    from modelyard.front.dispatch.relay import Relay

# Ollama's default `num_keep`: the first tokens of a generate prompt survive its truncation.
NUM_KEEP = 4
# The share of the context a cut prompt aims below (the estimate is by length, not tokens).
_AIM = 0.9
# A message's template tokens (role markers, separators), counted as this many characters.
_MESSAGE_OVERHEAD = 16

Fit = Callable[["ChatCall", dict[str, Any], int, int], "dict[str, Any] | None"]


async def fitted(open_relay: Callable[[bytes], Awaitable[Relay]], body: bytes, call: ChatCall,
                 fit: Fit) -> Relay:  # fmt: skip
    """The relay for `body`, or for the shorter bodies `fit` makes while the backend says the
    prompt is longer than its context; the backend's last answer when it cannot be cut."""
    while True:
        relay = await open_relay(body)
        if relay.status != 400:
            return relay
        counts = context_overflow(400, await relay.read())  # kept: it may be the answer
        shorter = None if counts is None else fit(call, orjson.loads(body), *counts)
        if shorter is None:
            return relay
        body = orjson.dumps(shorter)


def answer_room(payload: dict[str, Any], n_ctx: int) -> int:
    """The tokens a cut prompt leaves for the answer."""
    asked = payload.get("max_tokens", payload.get("n_predict"))
    room = n_ctx // 4
    if isinstance(asked, int) and 0 < asked < room:
        room = asked
    return room


def drop_turns(call: ChatCall, payload: dict[str, Any], n_prompt: int,
               n_ctx: int) -> dict[str, Any] | None:  # fmt: skip
    """/api/chat: `payload` without its oldest turns, so that it fits `n_ctx`; None when only
    the system message(s) and the last message are left."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or len(messages) < 2:
        return None
    last = len(messages) - 1
    weights = [_weight(m) for m in messages]
    per_weight = n_prompt / max(1, sum(weights))
    budget = (n_ctx - answer_room(payload, n_ctx)) * _AIM
    system = [i for i, m in enumerate(messages) if _role(m) == "system"]
    # Ollama's rule: the latest message always, and from it back every message that fits,
    # with the system messages before the cut.
    cut = last
    kept = weights[last] + sum(weights[i] for i in system if i < last)
    for i in range(last - 1, -1, -1):
        if _role(messages[i]) == "system":
            continue
        if (kept + weights[i]) * per_weight > budget:
            break
        kept += weights[i]
        cut = i
    dropped = [i for i in range(cut) if _role(messages[i]) != "system"]
    if not dropped:  # the estimate says it fits, the backend said not: one more goes
        first = next((i for i in range(last) if _role(messages[i]) != "system"), None)
        if first is None:
            return None  # the system message(s) and the last one: nothing more to drop
        cut = first + 1
    # A turn begins with the user: not with an answer, nor a tool's result whose call is gone
    # (a template may refuse either).
    while cut < last and _role(messages[cut]) != "user":
        cut += 1
    kept_messages = [m for i, m in enumerate(messages) if i >= cut or _role(m) == "system"]
    return {**payload, "messages": kept_messages}


def keep_end(call: ChatCall, payload: dict[str, Any], n_prompt: int,
             n_ctx: int) -> dict[str, Any] | None:  # fmt: skip
    """/api/generate: `payload` with the end of its prompt (token ids, a text, or the user
    message's text), so that it fits `n_ctx`; None when nothing can be cut."""
    budget = n_ctx - answer_room(payload, n_ctx)
    prompt = payload.get("prompt")
    if isinstance(prompt, list):  # token ids (front/chat/ollama_context.py): an exact cut
        if len(prompt) <= budget or budget <= NUM_KEEP:
            return None
        ids = [*prompt[:NUM_KEEP], *prompt[len(prompt) - (budget - NUM_KEEP):]]
        if call.context_prefix is not None:
            call.context_prefix = ids  # the `context` returned is what the model read
        return {**payload, "prompt": ids}
    if isinstance(prompt, str):
        cut = _tail(prompt, n_prompt, budget)
        return None if cut is None else {**payload, "prompt": cut}
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    text = messages[-1].get("content") if isinstance(messages[-1], dict) else None
    if not isinstance(text, str):
        return None  # images: not cut
    cut = _tail(text, n_prompt, budget)
    if cut is None:
        return None
    return {**payload, "messages": [*messages[:-1], {**messages[-1], "content": cut}]}


def _tail(text: str, n_prompt: int, budget: int) -> str | None:
    """The end of `text`, about `budget` of its `n_prompt` tokens, and shorter than it."""
    keep = min(int(len(text) * budget * _AIM / max(1, n_prompt)), len(text) * 9 // 10)
    return text[len(text) - keep:] if keep > 0 else None


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


def _weight(message: Any) -> int:
    """A message's share of the prompt, in characters."""
    if not isinstance(message, dict):
        return _MESSAGE_OVERHEAD
    return _MESSAGE_OVERHEAD + len(orjson.dumps(message.get("content"))) + (
        len(orjson.dumps(message["tool_calls"])) if message.get("tool_calls") else 0)
