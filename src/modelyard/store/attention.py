"""A Hugging Face repo's attention heads (config.json), for vLLM's tensor-parallel sizes
(placement/tensor_parallel.py)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["attention_heads"]


def attention_heads(repo_dir: Path) -> int | None:
    """`num_attention_heads` of the repo's config.json (a multimodal repo's `text_config`, which
    vLLM shards, when the top level does not say); None when it cannot be read."""
    try:
        config = json.loads((repo_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for scope in (config, config.get("text_config"), config.get("llm_config")):
        if isinstance(scope, dict):
            heads = scope.get("num_attention_heads")
            if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0:
                return heads
    return None
