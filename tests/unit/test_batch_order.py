"""The batch runner's choice of the next model (front/batches/order.py), as a table."""

from __future__ import annotations

import itertools

import pytest

from modelyard.front.batches.order import next_model

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

FIRST = {"a": 0, "b": 1, "c": 2}


@pytest.mark.parametrize(("pending", "loaded", "current", "blocked", "expected"), [
    # The model being drained keeps going while it has lines: all its lines together.
    ({"a": 3, "b": 9}, (), "a", (), "a"),
    # Done with the current one: a loaded model next (no load at all)…
    ({"a": 0, "b": 9, "c": 1}, ("c",), "a", (), "c"),
    # …else the one with the most lines (its load pays for the most work)…
    ({"a": 2, "b": 5, "c": 5}, (), None, (), "b"),
    # …ties by the earliest line in the files.
    ({"a": 5, "b": 5}, (), None, (), "a"),
    # Never ahead of interactive waiters: a model whose queue has waiters is skipped.
    ({"a": 3, "b": 1}, ("a",), "a", ("a",), "b"),
    ({"a": 3}, (), None, ("a",), None),
    ({}, (), None, (), None),
])
def test_next_model(pending: dict[str, int], loaded: tuple[str, ...], current: str | None,
                    blocked: tuple[str, ...], expected: str | None) -> None:
    assert next_model(pending, loaded=loaded, current=current, first_line=FIRST,
                      blocked=blocked) == expected


def test_a_mixed_file_loads_each_model_once() -> None:
    """Drained in the order next_model picks, an interleaved file changes model twice (three
    models), where its own order changes model at every line."""
    lines = ["a", "b", "c"] * 5
    pending = {m: lines.count(m) for m in "abc"}
    current, changes = None, 0
    for _ in lines:
        model = next_model(pending, loaded=(), current=current, first_line=FIRST)
        assert model is not None
        changes += model != current
        current = model
        pending[model] -= 1
    assert changes == 3
    assert sum(a != b for a, b in itertools.pairwise(lines)) + 1 == 15
