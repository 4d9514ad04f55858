"""Ollama's `suffix` on /api/generate: fill in the middle, through llama-server's `/infill`.

Only a model with fill-in-the-middle tokens can: llama-server reads them from the GGUF
(`tokenizer.ggml.fim_pre_token_id`, formerly `prefix_token_id`) and refuses /infill without
them. Ollama answers `suffix` for such a model with a 400 "model does not support insert"; so
does this, before a lease is taken. Any OpenAI server is asked (it decides); the transformers
engine and services cannot.

/infill speaks llama-server's own completion shape (`content`, `stop`, `stop_type`, `timings`,
streamed as SSE without `[DONE]`), which `Generation.absorb` reads like the OpenAI one.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from modelyard.config import LlamaCppModel, OpenAIServerModel
from modelyard.errors import InvalidRequest

INFILL_PATH = "/infill"
_FIM_KEYS = ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id")
# OpenAI request field → llama-server's native one, where they differ.
_NATIVE_NAMES = {"max_tokens": "n_predict"}
_DROP = ("stream_options", "response_format", "tools", "messages", "prompt")


@functools.lru_cache(maxsize=256)
def _gguf_has_fim(path: str, mtime_ns: int, size: int) -> bool:
    from modelyard.store.gguf import GgufError, read_gguf_info

    try:
        meta = read_gguf_info(Path(path)).metadata
    except (GgufError, OSError):
        return False
    return any(meta.get(k) is not None for k in _FIM_KEYS)


def supports_insert(spec: Any) -> bool:
    if isinstance(spec, LlamaCppModel):
        try:
            stat = Path(spec.path).stat()
        except OSError:
            return False
        return _gguf_has_fim(str(spec.path), stat.st_mtime_ns, stat.st_size)
    return isinstance(spec, OpenAIServerModel)


def check_insert_for(state: Any, model: str) -> None:
    """Ollama's 400 for `suffix` asked of a model without fill-in-the-middle tokens; a name the
    registry cannot resolve is left to the relay (model_not_found)."""
    try:
        entry = state.catalog.registry.resolve(model)
    except Exception:  # unresolvable names are the relay's to report
        return
    if not supports_insert(entry.spec):
        raise InvalidRequest("model does not support insert", param="suffix", model=model)


def infill_payload(params: dict[str, Any], prefix: str, suffix: str) -> dict[str, Any]:
    """The /infill request for the OpenAI-shaped `params` (sampling, limits, stream)."""
    body = {_NATIVE_NAMES.get(k, k): v for k, v in params.items() if k not in _DROP}
    return {**body, "input_prefix": prefix, "input_suffix": suffix, "prompt": ""}
