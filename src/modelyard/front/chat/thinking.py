"""Ollama's `think`: whether a model can reason apart from its answer, and the request fields
that turn that reasoning on or off.

llama-server extracts a reasoning model's thoughts into `reasoning_content` (its
`reasoning_format`), and a template that can switch thinking reads `enable_thinking` from
`chat_template_kwargs`. Ollama answers `think: true` for a model whose template has no thinking
with a 400 `"<model>" does not support thinking`; so does this, before a lease is taken.
Order, as for tools (front/chat/tools/support.py): the model's explicit `thinking` setting wins
(when the config has one); llama.cpp can when its chat template (`chat_template_file`, else the
GGUF's own) has thinking markers; any OpenAI server can (the server decides); the transformers
engine and services cannot (the transformers engine has no reasoning parser).
"""

from __future__ import annotations

from typing import Any

from modelyard.config import LlamaCppModel, OpenAIServerModel
from modelyard.errors import InvalidRequest
from modelyard.front.chat.tools.support import gguf_template

# What the chat templates of reasoning models mention: Qwen3's and DeepSeek's switch and
# tags, gpt-oss's `thinking` message field and `reasoning_effort`, `reasoning_content` turns.
_MARKERS = ("enable_thinking", "<think>", "reasoning_content", "thinking", "reasoning_effort")

Think = bool | str | None  # Ollama's field: true/false, or a level ("low", "medium", "high")
LEVELS = ("low", "medium", "high")


def template_supports_thinking(template: str) -> bool:
    return any(m in template for m in _MARKERS)


def supports_thinking(spec: Any) -> bool:
    explicit = getattr(spec, "thinking", None)
    if explicit is not None:
        return bool(explicit)
    if isinstance(spec, LlamaCppModel):
        return template_supports_thinking(gguf_template(spec))
    return isinstance(spec, OpenAIServerModel)


def check_think(value: Any) -> Think:
    """The `think` field as sent, or a 400 naming it."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value in LEVELS:
        return value
    raise InvalidRequest(
        f"think: {value!r} is not true, false, \"low\", \"medium\" or \"high\"", param="think")


def wants_thinking(think: Think) -> bool:
    return think is not None and think is not False


def check_thinking_for(state: Any, model: str, think: Think) -> None:
    """400 `"<model>" does not support thinking` (Ollama's words) for `think` asked of a model
    without it; a name the registry cannot resolve is left to the relay (model_not_found)."""
    if not wants_thinking(think):
        return
    try:
        entry = state.catalog.registry.resolve(model)
    except Exception:  # unresolvable names are the relay's to report
        return
    if not supports_thinking(entry.spec):
        raise InvalidRequest(f'"{model}" does not support thinking', param="think", model=model)


def thinking_fields(think: Think) -> dict[str, Any]:
    """The llama-server request fields for `think`: nothing when unset (the model's default;
    reasoning it emits still comes back as `thinking`)."""
    if think is None:
        return {}
    if think is False:
        return {"chat_template_kwargs": {"enable_thinking": False}}
    kwargs: dict[str, Any] = {"enable_thinking": True}
    if isinstance(think, str):
        kwargs["reasoning_effort"] = think  # gpt-oss's template reads the level from here
    return {"chat_template_kwargs": kwargs, "reasoning_format": "deepseek"}
