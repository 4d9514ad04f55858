"""Speculative decoding's pairing: which file a model's `draft_model` names, checked before a load.

A draft is named by catalog id (another GGUF model: declared, pulled or the demo) or by path.
The engine resolves it once per load (engine/loop.py), so the backend and the memory estimate
see a concrete .gguf path and a wrong draft is refused before anything is evicted for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from modelyard.config import (
    DEMO_MODEL_FILE,
    DEMO_MODEL_ID,
    LlamaCppModel,
    ModelSpec,
    Settings,
    draft_is_path,
)
from modelyard.errors import InvalidRequest
from modelyard.store.refs import parse_ref


class _Entry(Protocol):
    @property
    def spec(self) -> ModelSpec: ...


class _Registry(Protocol):
    def get(self, name: str) -> _Entry | None: ...


def draft_path(spec: LlamaCppModel, registry: _Registry | None, settings: Settings) -> Path | None:
    """The .gguf file of `spec`'s draft (None: it has none). Raises a 4xx that says what to do:
    a 400 `invalid_request` (param `draft_model`) that names the draft to pull or declare, or
    says it is of another backend family (llama-server drafts only with a GGUF)."""
    name = spec.draft_model
    if name is None:
        return None
    if draft_is_path(name):
        path = Path(name).expanduser()
        if not path.is_file():
            raise _bad(spec, f"draft_model '{name}' of '{spec.id}' is not a file: fix its path")
        return path
    entry = draft_entry(name, registry)
    if entry is None:
        if name == DEMO_MODEL_ID and (settings.models_dir / DEMO_MODEL_FILE).is_file():
            return settings.models_dir / DEMO_MODEL_FILE
        # A missing draft says exactly what to pull (a hub ref) or declare (a local id).
        todo = (f"pull it first: `modelyard pull {name}`" if looks_like_hub_ref(name)
                else "declare it in `models` or pull it")
        raise _bad(spec, f"draft_model '{name}' of '{spec.id}' is not in the catalog; {todo}")
    draft = entry.spec
    if not isinstance(draft, LlamaCppModel):
        raise _bad(spec, f"draft_model '{name}' of '{spec.id}' is a {draft.backend} model; "
                         "llama-server drafts only with a GGUF model (same backend family)")
    if draft.draft_model is not None:
        raise _bad(spec, f"draft_model '{name}' of '{spec.id}' has a draft of its own; a draft "
                         "is one model")
    return draft.path


def draft_entry(name: str, registry: _Registry | None) -> _Entry | None:
    """The catalog entry a draft's name reaches: its id or alias, or for a hub reference
    (`hf.co/org/repo:Q4_K_M`) the id its pull gave it (`org/repo:q4_k_m`, store/refs.py)."""
    if registry is None:
        return None
    entry = registry.get(name)
    if entry is None and looks_like_hub_ref(name):
        entry = registry.get(parse_ref(name).model_id)
    return entry


def missing_hub_draft(spec: ModelSpec, registry: _Registry | None) -> str | None:
    """The hub reference `spec`'s draft names when it is not in the catalog yet: what a pull
    of the pair, or `auto_pull` before a load, fetches (front/ops/draft_pulls.py). None: no
    draft, a path, a local id, or a draft already pulled."""
    if not isinstance(spec, LlamaCppModel) or spec.draft_model is None:
        return None
    name = spec.draft_model
    if draft_is_path(name) or not looks_like_hub_ref(name):
        return None
    return name if draft_entry(name, registry) is None else None


def _bad(spec: ModelSpec, message: str) -> InvalidRequest:
    """A config mistake the request cannot get past: a 400 naming the field, before any load."""
    return InvalidRequest(message, param="draft_model", model=spec.id)


def with_draft_path(spec: ModelSpec, registry: _Registry | None, settings: Settings) -> ModelSpec:
    """`spec` with its draft resolved to a path (unchanged when it has none or is not llama.cpp)."""
    if not isinstance(spec, LlamaCppModel) or spec.draft_model is None:
        return spec
    path = draft_path(spec, registry, settings)
    return spec.model_copy(update={"draft_model": str(path)})


def looks_like_hub_ref(name: str) -> bool:
    try:
        parse_ref(name)
    except ValueError:
        return False
    return True
