"""What docs/compatibility.md claims, tied to the tests that prove it.

Each compatibility test says which cells of the table it proves with `@covers(feature, api…)`.
tests/e2e/compat/test_compat_table.py reads the table and fails when a cell marked supported or
partial has no test, or a test covers a cell the table does not claim; the covering tests
themselves run in the same `make test`, so the table cannot say more than the product does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., object])

APIS = ("OpenAI", "Ollama", "Anthropic")

# (feature, api) → the tests that prove it ("module::name").
COVERED: dict[tuple[str, str], set[str]] = {}


def covers(feature: str, *apis: str) -> Callable[[F], F]:
    for api in apis:
        if api not in APIS:
            raise ValueError(f"unknown API column {api!r}")

    def mark(fn: F) -> F:
        where = f"{fn.__module__.rsplit('.', 1)[-1]}::{getattr(fn, '__name__', fn)}"
        for api in apis:
            COVERED.setdefault((feature, api), set()).add(where)
        return fn

    return mark
