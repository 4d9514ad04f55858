"""Speculative decoding's pairs, pulled together (docs/multi-gpu.md "Speculative decoding").

A model's `draft_model` may name a hub reference (`hf.co/org/small-GGUF:Q4_K_M`). Only a
model declared in the config carries a draft (a pulled model's catalog entry has none of its
own), so "the model is pulled" means: a pull job succeeded whose catalog id is one of a
declared model's names (its id or an alias), or whose file is a declared model's `path`. Its
draft, when it is a hub reference not in the catalog yet, is then pulled as a job of its own
(listed in `/jobs` like any pull; two pulls of one reference share a job). With `auto_pull`,
loading a model whose draft is such a reference pulls the draft first (front/catalog.py), as
it would the model itself.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from modelyard.store.draft import missing_hub_draft
from modelyard.store.registry import Entry, ModelRegistry

log = logging.getLogger("modelyard.jobs")


class _Jobs(Protocol):
    async def submit(self, model: str, quantize: str = "auto", init: bool = False
                     ) -> tuple[dict[str, Any], bool]: ...


def paired_with(registry: ModelRegistry, job: dict[str, Any]) -> list[Entry]:
    """The declared models a succeeded pull `job` is: those with its catalog id among their
    names (a pulled row of that id is listed beside them, so the registry's lookup would give
    that row, which has no draft), and those whose file is the one pulled."""
    model_id = job.get("model_id")
    pulled = job.get("local_path")
    target = Path(pulled).resolve() if pulled else None
    found: list[Entry] = []
    for entry in registry.entries():
        if entry.source != "config":
            continue
        names = {_key(n) for n in (entry.name, *entry.spec.aliases)}
        if (model_id and _key(model_id) in names) or (
                target is not None and entry.path is not None
                and entry.path.resolve() == target):
            found.append(entry)
    return found


def _key(name: str) -> str:
    """A name as the registry compares it (store/registry.py)."""
    return name.strip().lower().removesuffix(":latest")


def drafts_to_pull(registry: ModelRegistry, job: dict[str, Any]) -> list[str]:
    """The hub references of the drafts the models pulled by `job` still miss (each once)."""
    out: list[str] = []
    for entry in paired_with(registry, job):
        draft = missing_hub_draft(entry.spec, registry)
        if draft is not None and draft not in out:
            out.append(draft)
    return out


async def pull_drafts(jobs: _Jobs, registry: ModelRegistry,
                      job: dict[str, Any]) -> list[dict[str, Any]]:
    """Submit the pulls of the drafts `job`'s models miss; the jobs (not awaited)."""
    submitted = []
    for draft in drafts_to_pull(registry, job):
        draft_job, created = await jobs.submit(draft)
        if created:
            log.info("pulling %s, the draft model of what job %s pulled", draft, job.get("id"))
        submitted.append(draft_job)
    return submitted
