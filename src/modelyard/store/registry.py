"""The models this server knows: declared ones, the demo model, and what discovery finds.

Declared models win over discovered ones with the same id or path. Names resolve by id, then
alias, then case-insensitively, and an Ollama-style `:latest` tag is ignored, so `smollm2`,
`SmolLM2` and `smollm2:latest` reach the same model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from modelyard.config import (
    DEMO_MODEL_FILE,
    DEMO_MODEL_ID,
    LlamaCppModel,
    ModelSpec,
    Settings,
)
from modelyard.errors import ModelNotFound
from modelyard.store.catalog import (
    DiscoveredModel,
    default_hf_cache_dir,
    scan_hf_cache,
    scan_model_dirs,
)

Source = Literal["config", "demo", "dir", "hf_cache"]


@dataclass(frozen=True)
class Entry:
    spec: ModelSpec
    source: Source

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def format(self) -> str:
        return "gguf" if self.spec.backend == "llamacpp" else "openai"

    @property
    def path(self) -> Path | None:
        return self.spec.path

    @property
    def size_bytes(self) -> int | None:
        path = self.spec.path
        try:
            return path.stat().st_size if path is not None else None
        except OSError:
            return None


def _key(name: str) -> str:
    name = name.strip().lower()
    return name.removesuffix(":latest")


class ModelRegistry:
    def __init__(self, entries: Iterable[Entry]) -> None:
        self._entries: dict[str, Entry] = {}
        self._names: dict[str, str] = {}
        for entry in entries:
            if entry.id in self._entries:
                continue
            self._entries[entry.id] = entry
            for name in (entry.id, *entry.spec.aliases):
                self._names.setdefault(_key(name), entry.id)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def get(self, name: str) -> Entry | None:
        if name in self._entries:
            return self._entries[name]
        model_id = self._names.get(_key(name))
        return self._entries[model_id] if model_id is not None else None

    def resolve(self, name: str) -> Entry:
        entry = self.get(name)
        if entry is None:
            raise ModelNotFound(name)
        return entry

    @classmethod
    def build(cls, settings: Settings) -> ModelRegistry:
        declared = [Entry(spec, "config") for spec in settings.models]
        seen_paths = {e.path.resolve() for e in declared if e.path is not None}
        seen_ids = {e.id for e in declared}

        demo_path = settings.models_dir / DEMO_MODEL_FILE
        if demo_path.is_file() and DEMO_MODEL_ID not in seen_ids and (
            demo_path.resolve() not in seen_paths
        ):
            declared.append(Entry(LlamaCppModel(id=DEMO_MODEL_ID, path=demo_path), "demo"))
            seen_paths.add(demo_path.resolve())

        found: list[tuple[DiscoveredModel, Source]] = [
            (m, "dir") for m in scan_model_dirs([settings.models_dir, *settings.model_dirs])
        ]
        if settings.scan_hf_cache:
            hf = settings.hf_cache_dir or default_hf_cache_dir()
            found += [(m, "hf_cache") for m in scan_hf_cache(hf)]

        discovered = []
        for model, source in found:
            if model.path.resolve() in seen_paths or model.id in seen_ids:
                continue
            spec = LlamaCppModel(id=model.id, path=model.path, mmproj=model.mmproj)
            discovered.append(Entry(spec, source))
        return cls([*declared, *discovered])
