"""The check that a model serves what a route asks of it, before any load.

Embeddings ask an `embedding` model and rerank a `rerank` one (store.kinds). Without this check a
chat model on llama-server answers embeddings with a 501 (which the OpenAI SDK retries) and a
chat model on the transformers backend with an error that names nothing better; here the client
gets a 400 (`model_not_embedding` / `model_not_reranker`) naming models that can, and an unknown
name (e.g. Ollama's `nomic-embed-text`, not shipped) a 404 that suggests them.
"""

from __future__ import annotations

import asyncio

from modelyard.errors import ModelNotFound, WrongModelKind
from modelyard.front.state import FrontState
from modelyard.store.kinds import ModelKind
from modelyard.store.registry import EMBEDDING_DEMO_ID, ModelRegistry, looks_like_hub_ref

_WHAT = {"embedding": "embeddings", "rerank": "reranking"}


def models_of_kind(registry: ModelRegistry, kind: ModelKind) -> list[str]:
    """Names of the models of `kind`, the built-in embedding model first."""
    names = [e.name for e in registry.entries() if e.kind == kind]
    return sorted(names, key=lambda n: (n != EMBEDDING_DEMO_ID, n))


def _check(registry: ModelRegistry, model: str, needs: ModelKind) -> None:
    entry = registry.get(model)
    if entry is None:
        if looks_like_hub_ref(model):
            return  # open_relay pulls it (auto_pull) or says how to
        found = models_of_kind(registry, needs)
        hint = (f"models that serve {_WHAT[needs]} here: {', '.join(found[:5])}" if found
                else "")
        raise ModelNotFound(model, hint)
    kind = entry.kind  # reads a config.json or a GGUF header (cached): in a worker thread
    if kind is None or kind == needs:
        return  # None: a server modelyard does not start says itself what it serves
    raise WrongModelKind.for_model(model, kind, needs, models_of_kind(registry, needs))


# The catalog entries that passed a check, by (name, kind needed): the same entry asked again
# passes without a worker thread (handing `_check` to one costs more than the rest of an
# embedding request's front). A changed model is a new entry (a rescan, a reload): checked anew.
_passed: dict[tuple[str, ModelKind], object] = {}
_PASSED_MAX = 1024


async def require_kind(state: FrontState, model: str, needs: ModelKind) -> None:
    """Raise unless `model` can serve `needs` (a model this server cannot tell passes)."""
    registry = state.catalog.registry
    entry = registry.get(model)
    if entry is not None and _passed.get((model, needs)) is entry:
        return
    await asyncio.to_thread(_check, registry, model, needs)
    if entry is not None:
        if len(_passed) >= _PASSED_MAX:  # names of variants a client makes up: bounded
            _passed.clear()
        _passed[(model, needs)] = entry
