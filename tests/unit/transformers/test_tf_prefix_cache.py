"""The prefix cache on its own: longest shared prefix, LRU by tokens, redundancy, stats."""

from __future__ import annotations

import pytest

from modelyard.engine.backends.transformers.prefix_cache import PrefixCache, common_prefix

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@pytest.mark.parametrize(("a", "b", "n"), [
    ([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2), ([1, 2, 3], [1, 9, 3], 1),
    ([5], [6], 0), (list(range(1000)), [*range(777), -1], 777),
])
def test_common_prefix(a: list[int], b: list[int], n: int) -> None:
    assert common_prefix(a, b) == common_prefix(b, a) == n


def test_longest_shared_prefix_of_any_entry() -> None:
    cache: PrefixCache[str] = PrefixCache(100)
    cache.insert([1, 2, 3, 4, 5], "a")
    cache.insert([1, 2, 9, 9], "b")
    hit = cache.lookup([1, 2, 3, 7, 7, 7])
    assert hit is not None and (hit.tokens, hit.value) == (3, "a")
    hit = cache.lookup([1, 2, 9, 9, 9])
    assert hit is not None and (hit.tokens, hit.value) == (4, "b")
    hit = cache.lookup([1, 2, 3, 4, 5], max_tokens=4)  # leave a token to compute
    assert hit is not None and hit.tokens == 4
    assert cache.lookup([7, 1, 2]) is None
    assert cache.stats() | {"hit_rate": 0} == {
        "hits": 3, "misses": 1, "hit_rate": 0, "entries": 2, "tokens_cached": 9,
        "capacity_tokens": 100, "tokens_reused": 11}
    assert cache.stats()["hit_rate"] == 0.75


def test_lru_eviction_by_tokens() -> None:
    cache: PrefixCache[str] = PrefixCache(10)
    assert cache.insert([1, 1, 1, 1], "a")
    assert cache.insert([2, 2, 2, 2], "b")
    assert cache.lookup([1, 1, 1, 1, 0]) is not None  # "a" is now the most recent
    assert cache.insert([3, 3, 3, 3], "c")  # 12 > 10 tokens: "b" goes
    assert cache.lookup([2, 2, 2, 2]) is None
    assert cache.lookup([1, 1, 1, 1]) is not None
    assert cache.tokens_cached == 8 and len(cache) == 2
    assert not cache.insert(list(range(11)), "too big")


def test_an_extension_replaces_its_prefix_and_a_prefix_is_not_stored() -> None:
    cache: PrefixCache[str] = PrefixCache(100)
    cache.insert([1, 2, 3], "turn 1")
    assert cache.insert([1, 2, 3, 4, 5, 6], "turn 2")
    assert len(cache) == 1 and cache.tokens_cached == 6
    assert not cache.insert([1, 2, 3, 4], "covered")
    hit = cache.lookup([1, 2, 3, 0])
    assert hit is not None and hit.value == "turn 2" and hit.tokens == 3


def test_min_tokens_and_disabled_cache() -> None:
    cache: PrefixCache[str] = PrefixCache(100, min_tokens=4)
    assert not cache.insert([1, 2, 3], "short")
    cache.insert([1, 2, 3, 4, 5], "x")
    assert cache.lookup([1, 2, 3, 9]) is None  # 3 shared tokens are not worth it
    off: PrefixCache[str] = PrefixCache(0)
    assert not off.insert([1, 2, 3], "x")
    assert off.lookup([1, 2, 3]) is None
