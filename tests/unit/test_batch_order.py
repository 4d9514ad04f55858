"""The batch runner's choice of the next model (front/batches/order.py), as a table."""

from __future__ import annotations

import itertools

import pytest

from modelyard.front.batches.order import next_model, next_turn

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


@pytest.mark.parametrize(("candidates", "owners", "batches", "expected"), [
    # Nobody served yet: the first given (the oldest batch).
    ([("alice", "b1"), ("bob", "b2")], {}, {}, 0),
    # alice just had a turn: bob's batch goes next, however big alice's is.
    ([("alice", "b1"), ("bob", "b2")], {"alice": 5}, {"b1": 5}, 1),
    # A newcomer (never served) goes before anyone served.
    ([("alice", "b1"), ("bob", "b2"), ("carol", "b3")], {"alice": 4, "bob": 3},
     {"b1": 4, "b2": 3}, 2),
    # Owners first: bob's one batch is not outnumbered by alice's three.
    ([("alice", "b1"), ("alice", "b2"), ("alice", "b3"), ("bob", "b4")],
     {"alice": 9, "bob": 8}, {"b1": 7, "b2": 9, "b3": 6, "b4": 8}, 3),
    # Within an owner: the batch served least recently.
    ([("alice", "b1"), ("alice", "b2"), ("alice", "b3")], {"alice": 9},
     {"b1": 7, "b2": 9, "b3": 6}, 2),
])
def test_next_turn_is_round_robin_over_owners_then_their_batches(
    candidates: list[tuple[str, str]], owners: dict[str, int], batches: dict[str, int],
    expected: int,
) -> None:
    assert next_turn(candidates, owners, batches) == expected


def test_next_turn_alternates_two_owners_one_line_at_a_time() -> None:
    owners: dict[str, int] = {}
    batches: dict[str, int] = {}
    order = []
    for turn in range(6):
        i = next_turn([("alice", "big"), ("bob", "small")], owners, batches)
        owner, batch = [("alice", "big"), ("bob", "small")][i]
        owners[owner] = batches[batch] = turn
        order.append(owner)
    assert order == ["alice", "bob"] * 3
