"""The front's catalog as it travels to engines: `CatalogSnapshot` (POST /rescan's body).

The front owns the catalog (its database: pulled and imported models, aliases, created presets;
its configuration; its scans): engines never read the front's database, since on another machine
it is not there. The front pushes the whole catalog to every engine after each change and when an
engine attaches (its first start and every restart), before it publishes the engine up.

Entries are carried as JSON dicts: their specs are config.py models, which wire/ may not import;
store/registry.py (`entry_to_json` / `entry_from_json`) (de)serializes them and the engine
validates them there. `storage_id` is the id the front found in its `models_dir`
(wire/cluster.py STORAGE_ID_FILE): an engine that reads the same id at the same path shares the
front's storage; one that does not cannot see the files of models the front pulled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CATALOG_FORMAT = 1  # bumped when an older engine could not read the entries


class BadCatalog(ValueError):
    """A body that is not a catalog snapshot (the engine answers 400 invalid_request)."""


@dataclass(frozen=True)
class CatalogSnapshot:
    version: int  # grows with every rescan of the front (an engine ignores an older one)
    entries: tuple[dict[str, Any], ...]  # store/registry.py entry_to_json, in listing order
    aliases: dict[str, str]  # alias → entry name (/api/copy's, from the database)
    storage_id: str | None = None  # the front's models_dir/STORAGE_ID_FILE
    models_dir: str | None = None  # where the front read it (the same path on a shared mount)
    format: int = CATALOG_FORMAT

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "version": self.version,
            "entries": list(self.entries),
            "aliases": dict(self.aliases),
            "storage_id": self.storage_id,
            "models_dir": self.models_dir,
        }

    @classmethod
    def from_json(cls, d: Any) -> CatalogSnapshot:
        """The snapshot in `d`; BadCatalog names what is wrong (the engine's 400)."""
        if not isinstance(d, Mapping):
            raise BadCatalog("a catalog is a JSON object")
        fmt = d.get("format", CATALOG_FORMAT)
        if fmt != CATALOG_FORMAT:
            raise BadCatalog(f"catalog format {fmt!r}: this engine reads {CATALOG_FORMAT}")
        version = d.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise BadCatalog("'version' must be a non-negative integer")
        entries = d.get("entries")
        if not isinstance(entries, list) or not all(isinstance(e, Mapping) for e in entries):
            raise BadCatalog("'entries' must be a list of objects")
        aliases = d.get("aliases") or {}
        if not isinstance(aliases, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()
        ):
            raise BadCatalog("'aliases' must map names to names")
        storage_id, models_dir = d.get("storage_id"), d.get("models_dir")
        if not isinstance(storage_id, str | None) or not isinstance(models_dir, str | None):
            raise BadCatalog("'storage_id' and 'models_dir' must be strings or null")
        return cls(version, tuple(dict(e) for e in entries), dict(aliases), storage_id,
                   models_dir)
