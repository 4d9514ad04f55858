"""The catalog builds a listing once per registry (front/catalog.py): /v1/models of 10,000 models
is encoded once, not per request, and a reload or rescan (a new registry) builds it again."""

from __future__ import annotations

from typing import Any, cast

import pytest

from modelyard.config import LlamaCppModel, Settings
from modelyard.front.catalog import Catalog
from modelyard.store.registry import Entry, ModelRegistry

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def registry(*ids: str) -> ModelRegistry:
    return ModelRegistry(Entry(LlamaCppModel(id=i, path=f"/m/{i}.gguf"), "config") for i in ids)


def test_a_listing_is_built_once_per_registry() -> None:
    catalog = Catalog(Settings(), registry("a", "b"), cast(Any, None), cast(Any, None))
    builds: list[list[str]] = []

    def names(r: ModelRegistry) -> list[str]:
        builds.append([n for n, _ in r.names()])
        return builds[-1]

    assert catalog.memo("names", names) == ["a", "b"]
    assert catalog.memo("names", names) is builds[0]
    assert len(builds) == 1
    catalog.registry = registry("a", "b", "c")  # what a reload or rescan does
    assert catalog.memo("names", names) == ["a", "b", "c"]
    assert len(builds) == 2


def test_count_is_the_number_of_entries() -> None:
    assert registry("a", "b", "c").count() == 3
    assert registry().count() == 0
