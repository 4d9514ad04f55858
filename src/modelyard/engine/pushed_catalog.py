"""The catalog an engine serves, as the front pushed it (wire/catalog.py).

The front owns the catalog; an engine takes each snapshot the front pushes (POST /rescan, and on
every attach) and, in a cluster, never opens the front's database: on another machine it is not
there. A local engine (same home as its front) still builds its first catalog itself, database
included, so that it serves at once; the front's push then replaces it.

It also tells the front which of the catalog's files it cannot see (store/storage_id.py): the
front routes a model to engines that hold its files first (front/dispatch/routing.py). A pulled
model this node lacks is pulled here on its first load (engine/node_pull.py); where that copy
lies elsewhere than the front's, every later push of the same ref and revision is served from it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from modelyard.config import Settings
from modelyard.engine.node_pull import Hub, LocalCopy, with_local_copies
from modelyard.store.registry import ModelRegistry, stored_of
from modelyard.store.storage_id import read_storage_id
from modelyard.wire.catalog import CatalogSnapshot
from modelyard.wire.cluster import TOKEN_FILE_ENV


def catalog_pushed(settings: Settings, env: Mapping[str, str] | None = None) -> bool:
    """Whether this engine's catalog comes only from its front: a cluster's engines (started by
    a node agent, which sets the token file in their environment)."""
    env = os.environ if env is None else env
    return settings.cluster.mode == "ray" or bool(env.get(TOKEN_FILE_ENV))


def missing_files(registry: ModelRegistry) -> tuple[str, ...]:
    """The ids of the models whose file (or folder) is not on this node, as the front routes
    them (blocking: stats every path)."""
    missing: dict[str, None] = {}
    for entry in registry.entries():
        path = entry.path
        if path is not None and not path.exists():
            missing[entry.id] = None
    return tuple(missing)


class PushedCatalog:
    """The last snapshot the front pushed, and what this node lacks of it."""

    def __init__(self, pushed_only: bool) -> None:
        self.pushed_only = pushed_only  # never build from the database
        self.snapshot: CatalogSnapshot | None = None
        self.storage_id: str | None = None  # the id this node reads in its models_dir
        self.missing: tuple[str, ...] = ()
        # This node's own copies of pulled models (by ref, revision, quantize), where they lie
        # elsewhere than the path the front pushes: they outlive every later push.
        self.copies: dict[Hub, LocalCopy] = {}

    def accept(self, snapshot: CatalogSnapshot, settings: Settings) -> ModelRegistry | None:
        """The registry `snapshot` describes, None for one older than the last (two pushes
        crossed). Blocking (files are checked): run it in a thread. ValueError: an entry this
        version cannot read."""
        registry = ModelRegistry.from_snapshot(snapshot)  # a bad one is refused, stale or not
        if self.snapshot is not None and snapshot.version < self.snapshot.version:
            return None
        self.snapshot = snapshot
        registry = with_local_copies(registry, self.copies)
        self.refresh(registry, settings.models_dir)
        return registry

    def adopt(self, hub: Hub, copy: LocalCopy, registry: ModelRegistry) -> ModelRegistry:
        """`registry` serving the model pulled to `copy` from there, as every later push will.
        No I/O: the loop applies it at once, so no push lands between (then `refresh`)."""
        self.copies[hub] = copy
        return with_local_copies(registry, self.copies)

    def refresh(self, registry: ModelRegistry, models_dir: Path) -> None:
        """Look at the disk again (after a pull on this node)."""
        self.storage_id = read_storage_id(models_dir)
        self.missing = missing_files(registry)

    def build(self, settings: Settings) -> ModelRegistry:
        """The catalog for `settings` (a start, a reload): with the database unless the catalog
        is pushed only, then with the last snapshot's database part. Blocking."""
        if not self.pushed_only:
            return with_local_copies(ModelRegistry.build(settings), self.copies)
        stored = stored_of(self.snapshot) if self.snapshot is not None else None
        registry = with_local_copies(ModelRegistry.build(settings, database=False, stored=stored),
                                     self.copies)
        self.refresh(registry, settings.models_dir)
        return registry
