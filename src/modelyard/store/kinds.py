"""What a model is for: chat (generation), embedding, or rerank. Read from files only (no torch).

The kind decides which routes a model answers (embeddings ask an `embedding` model, rerank a
`rerank` one; a chat model asked either gets a 400 that names one that can) and what
/api/show lists as its capabilities.

- a safetensors repo (config.json): a sentence-transformers repo or a bare encoder (`BertModel`,
  …) embeds; `*ForSequenceClassification` with one label is a cross-encoder (rerank);
  `*ForCausalLM` / `*ForConditionalGeneration` chats; anything else is not served (None);
- a GGUF file: its `{arch}.pooling_type` (llama.cpp's enum: 1 mean, 2 cls, 3 last embed; 4 rank
  reranks), else an encoder architecture (bert, nomic-bert, …) embeds, else it chats.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

ModelKind = Literal["chat", "embedding", "rerank"]

# llama.cpp's enum llama_pooling_type.
_GGUF_POOLING_EMBED = (1, 2, 3)
_GGUF_POOLING_RANK = 4
# GGUF architectures that have no causal head: they only embed.
_GGUF_ENCODERS = ("bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3",
                  "modern-bert", "neo-bert", "t5encoder")
# Architecture suffixes the transformers backend generates with.
_GENERATIVE = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")
_HEADS = ("For", "LMHead")


def _config(repo: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((repo / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _labels(config: dict[str, Any]) -> int:
    if isinstance(config.get("num_labels"), int):
        return int(config["num_labels"])
    id2label = config.get("id2label")
    return len(id2label) if isinstance(id2label, dict) else 2  # transformers' default is 2


def repo_kind(repo: Path) -> ModelKind | None:
    """The kind of the safetensors repo at `repo`; None when no backend here serves it."""
    try:
        stamp = os.stat(repo / "config.json").st_mtime_ns
    except OSError:
        stamp = 0
    return _repo_kind(str(repo), stamp)


@lru_cache(maxsize=512)
def _repo_kind(path: str, _mtime_ns: int) -> ModelKind | None:
    repo = Path(path)
    if (repo / "modules.json").is_file() or (repo / "sentence_bert_config.json").is_file():
        return "embedding"
    config = _config(repo)
    if config is None:
        return None
    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    if not archs:
        return None
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return "rerank" if _labels(config) == 1 else None
    if any(a.endswith(_GENERATIVE) for a in archs):
        return "chat"
    if all(a.endswith("Model") and not any(h in a for h in _HEADS) for a in archs):
        return "embedding"
    return None


def gguf_kind(path: Path) -> ModelKind:
    """The kind of the GGUF model at `path` (chat when its header cannot be read: llama-server
    will say what is wrong with it at load)."""
    try:
        stat = os.stat(path)
    except OSError:
        return "chat"
    return _gguf_kind(str(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=512)
def _gguf_kind(path: str, _mtime_ns: int, _size: int) -> ModelKind:
    # Imported here: the GGUF reader (numpy, gguf) is only needed once a GGUF is asked about.
    from modelyard.store.gguf import GgufError, read_gguf_info

    try:
        info = read_gguf_info(Path(path))
    except (GgufError, OSError, ValueError):
        return "chat"
    pooling = info.metadata.get(f"{info.architecture}.pooling_type")
    if pooling == _GGUF_POOLING_RANK:
        return "rerank"
    if pooling in _GGUF_POOLING_EMBED or info.architecture in _GGUF_ENCODERS:
        return "embedding"
    return "chat"
