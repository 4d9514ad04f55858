"""The front's catalog as its engines get it: the last snapshot (wire/catalog.py) the front made.

Engines never read the front's database (on another machine it is not there): the front pushes
the whole catalog to every engine after each change (front/catalog.py), and an engine client
pushes the current one when its engine attaches — first start, restart, a node that joins —
before the engine is published up (front/engines/client.py). Providers hand the feed to the
clients they make; the front's `Catalog` publishes into it.
"""

from __future__ import annotations

import time

from modelyard.config import Settings
from modelyard.store.registry import ModelRegistry
from modelyard.store.storage_id import ensure_storage_id
from modelyard.wire.catalog import CatalogSnapshot


class CatalogFeed:
    def __init__(self) -> None:
        self.current: CatalogSnapshot | None = None
        self._storage_id: str | None = None
        self._version = 0

    def publish(self, registry: ModelRegistry, settings: Settings) -> CatalogSnapshot:
        """A snapshot of `registry`, now the current one. Blocking (the storage-id file, once;
        the entries' JSON): run it in a thread."""
        if self._storage_id is None:
            self._storage_id = ensure_storage_id(settings.models_dir)
        # Versions grow across front restarts too (a cluster's engines outlive a front): an
        # engine ignores a snapshot older than its last, so two pushes that cross are harmless.
        self._version = max(self._version + 1, time.time_ns())
        snapshot = registry.to_snapshot(self._version, self._storage_id,
                                        str(settings.models_dir))
        self.current = snapshot
        return snapshot
