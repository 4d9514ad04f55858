"""SessionPins without torch: one pin per session, longest-common-prefix lookups of the asking
session only, a token budget that evicts whole sessions least recently used first."""

from __future__ import annotations

import pytest

from modelyard.engine.backends.transformers.session_pins import (
    MAX_KEY_CHARS,
    SessionPins,
    valid_session_key,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def test_lookup_is_the_longest_common_prefix_of_the_sessions_own_pin() -> None:
    pins: SessionPins[str] = SessionPins(100)
    assert pins.insert("a", [1, 2, 3, 4, 5], "A")
    assert pins.insert("b", [1, 2, 3, 9, 9, 9], "B")
    hit = pins.lookup("a", [1, 2, 3, 4, 7, 8])
    assert hit is not None and (hit.tokens, hit.value) == (4, "A")
    hit = pins.lookup("a", [1, 2, 3, 4, 5, 6], max_tokens=3)
    assert hit is not None and hit.tokens == 3
    assert pins.lookup("c", [1, 2, 3]) is None  # another session's pin is not consulted
    assert pins.lookup("a", [7, 2, 3]) is None
    s = pins.stats()
    assert (s["hits"], s["misses"], s["tokens_reused"]) == (2, 2, 7)
    assert s["hit_rate"] == 0.5 and s["sessions"] == 2


def test_a_new_turn_replaces_the_sessions_pin() -> None:
    pins: SessionPins[str] = SessionPins(100)
    pins.insert("a", [1, 2, 3], "turn1")
    pins.insert("a", [1, 2, 3, 4, 5, 6], "turn2")
    assert len(pins) == 1 and pins.tokens_cached == 6
    assert pins.tokens_of("a") == (1, 2, 3, 4, 5, 6)
    # even a pin that does not extend the old one replaces it
    pins.insert("a", [9, 9], "other")
    assert len(pins) == 1 and pins.tokens_cached == 2 and pins.tokens_of("a") == (9, 9)


def test_the_budget_evicts_the_least_recently_used_session_whole() -> None:
    pins: SessionPins[str] = SessionPins(10)
    pins.insert("a", [1] * 4, "A")
    pins.insert("b", [2] * 4, "B")
    assert pins.lookup("a", [1] * 5) is not None  # a is now the more recent
    pins.insert("c", [3] * 4, "C")
    assert "b" not in pins and "a" in pins and "c" in pins
    assert pins.tokens_cached == 8 and pins.stats()["evictions"] == 1
    pins.insert("a", [1] * 9, "A2")  # a's new turn alone nearly fills the budget: c goes
    assert list(pins._pins) == ["a"] and pins.tokens_cached == 9


def test_a_pin_over_the_budget_is_not_stored_and_keeps_the_old_one() -> None:
    pins: SessionPins[str] = SessionPins(5)
    assert pins.insert("a", [1, 2, 3], "A")
    assert not pins.insert("a", [1] * 6, "too long")
    assert pins.tokens_of("a") == (1, 2, 3)
    assert not SessionPins[str](0).insert("a", [1], "off")
    assert not SessionPins[str](10, min_tokens=3).insert("a", [1, 2], "short")


def test_drop_and_clear() -> None:
    pins: SessionPins[str] = SessionPins(100)
    pins.insert("a", [1, 2], "A")
    pins.insert("b", [3, 4, 5], "B")
    assert pins.drop("a") and not pins.drop("a") and not pins.drop("zzz")
    assert pins.tokens_cached == 3 and len(pins) == 1
    pins.clear()
    assert pins.tokens_cached == 0 and len(pins) == 0


@pytest.mark.parametrize(("value", "ok"), [
    ("0af3", True), ("f" * MAX_KEY_CHARS, True), ("f" * (MAX_KEY_CHARS + 1), False),
    ("", False), (12, False), (None, False), (["a"], False),
])
def test_valid_session_key(value: object, ok: bool) -> None:
    assert (valid_session_key(value) is None) is ok
