"""What /api/show says a model can do, read from its files: Ollama's capability names
(completion, tools, vision, thinking, embedding, insert) and its `model_info`.

- tools / vision: the checks the chat pipeline itself enforces (front/chat/tools/support.py,
  front/chat/vision.py), so /api/show never promises what a request would be refused;
- thinking: the chat template reads `enable_thinking` or frames a `<think>` block;
- embedding: the model's kind (store/kinds.py: a GGUF's pooling type or encoder-only
  architecture, a sentence-transformers repo); such a model does not complete text;
- insert: the GGUF names fill-in-the-middle tokens (prefix/suffix/middle).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from modelyard.config import LlamaCppModel, ServiceModel, TransformersModel
from modelyard.front.chat.tools.support import chat_template_text, supports_tools
from modelyard.front.chat.vision import supports_vision
from modelyard.store.gguf import GgufInfo, cached_gguf_info
from modelyard.store.registry import Entry

_THINKING_MARKERS = ("<think>", "enable_thinking", "reasoning_content")
_FIM_KEYS = ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id")


def gguf_info(entry: Entry) -> GgufInfo | None:
    """The GGUF header of an entry's file (None for other formats or an unreadable file);
    cached per file version, so listings do not map the file again."""
    if entry.format != "gguf" or entry.path is None:
        return None
    return cached_gguf_info(entry.path)


def _template(entry: Entry, info: GgufInfo | None) -> str:
    spec = entry.spec
    if isinstance(spec, LlamaCppModel) and spec.chat_template_file is not None:
        try:
            return Path(spec.chat_template_file).read_text(encoding="utf-8")
        except OSError:
            return ""
    if isinstance(spec, TransformersModel) and spec.path is not None:
        return chat_template_text(Path(spec.path))
    return (info.chat_template or "") if info else ""


def capabilities(entry: Entry) -> list[str]:
    spec = entry.spec
    if isinstance(spec, ServiceModel):  # what its routes serve
        return [c for c, kind in (("completion", "chat"), ("embedding", "embeddings"))
                if kind in spec.paths]
    kind = entry.kind  # store/kinds.py: read from the files, the engine's own rule
    if kind == "embedding":
        return ["embedding"]
    if kind == "rerank":
        return []  # Ollama has no capability name for it; /v1/rerank serves it
    info = gguf_info(entry)
    caps = ["completion"]
    if supports_tools(entry.spec):
        caps.append("tools")
    if supports_vision(entry.spec):
        caps.append("vision")
    template = _template(entry, info)
    if any(m in template for m in _THINKING_MARKERS):
        caps.append("thinking")
    if info is not None and any(k in info.metadata for k in _FIM_KEYS):
        caps.append("insert")
    return caps


def model_info(info: GgufInfo | None) -> dict[str, Any]:
    """Ollama's `model_info`: the GGUF's keys (`general.architecture`, `<arch>.context_length`,
    …) with `general.parameter_count` as Ollama adds it; long arrays (the vocabulary) are
    their length, not their items."""
    if info is None:
        return {}
    out: dict[str, Any] = dict(info.metadata)
    out.setdefault("general.parameter_count", info.parameter_count)
    if info.context_length is not None:
        out.setdefault(f"{info.architecture}.context_length", info.context_length)
    return out
