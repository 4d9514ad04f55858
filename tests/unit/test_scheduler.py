"""Table tests of the engine's pure placement/eviction policy (DESIGN.md §3.1, §3.4)."""

import pytest

from modelyard.placement.policy import (
    Decision,
    Evict,
    Load,
    NoFit,
    Ready,
    Resident,
    Wait,
    Want,
    expired,
    plan,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

GiB = 1 << 30
TOTAL = 8 * GiB


def R(model: str, gib: float, **kw: object) -> Resident:
    return Resident(model, int(gib * GiB), **kw)  # type: ignore[arg-type]


def W(model: str, gib: float, **kw: object) -> Want:
    return Want(model, int(gib * GiB), **kw)  # type: ignore[arg-type]


CASES: list[tuple[str, Want, list[Resident], float, dict[str, int], Decision]] = [
    ("already-resident", W("a", 2), [R("a", 2)], 6, {}, Ready("a")),
    ("fits-loads", W("c", 3), [R("a", 2), R("b", 2)], 4, {}, Load("c")),
    (
        "lru-victim",
        W("c", 3),
        [R("a", 3, last_used=20), R("b", 3, last_used=10)],
        2,
        {},
        Evict(("b",), "c"),
    ),
    (
        "priority-beats-recency",
        W("c", 3),
        [R("a", 3, last_used=10, priority=5), R("b", 3, last_used=20, priority=1)],
        2,
        {},
        Evict(("b",), "c"),
    ),
    (
        "reload-cost-tie-break",
        W("c", 3),
        [R("a", 3, last_used=10, reload_cost_s=9), R("b", 3, last_used=10, reload_cost_s=1)],
        2,
        {},
        Evict(("b",), "c"),
    ),
    (
        "never-pinned",
        W("c", 3),
        [R("a", 3, last_used=1, pinned=True), R("b", 3, last_used=50)],
        2,
        {},
        Evict(("b",), "c"),
    ),
    (
        "leased-waits",
        W("c", 3),
        [R("a", 3, pinned=True), R("b", 3, leases=1)],
        2,
        {},
        Wait("", ("b",)),
    ),
    (
        "leased-skipped-for-idle",
        W("c", 3),
        [R("a", 3, last_used=1, leases=2), R("b", 3, last_used=50)],
        2,
        {},
        Evict(("b",), "c"),
    ),
    (
        "coexist-named-by-want",
        W("c", 3, coexist_with=frozenset({"a"})),
        [R("a", 3, last_used=1), R("b", 3, last_used=50)],
        2,
        {},
        Evict(("b",), "c"),
    ),
    (
        "coexist-named-by-resident",
        W("c", 3),
        [R("a", 3, last_used=1, coexist_with=frozenset({"c"})), R("b", 3, last_used=50)],
        2,
        {},
        Evict(("b",), "c"),
    ),
    (
        "same-group-cohabits",
        W("c", 3, group="g"),
        [R("a", 3, last_used=1, group="g"), R("b", 3, last_used=50, group="g")],
        2,
        {},
        NoFit(""),
    ),
    (
        "other-group-evicted-though-it-fits",
        W("c", 2, group="g"),
        [R("a", 2, group="g"), R("b", 2, group="h")],
        4,
        {},
        Evict(("b",), "c"),
    ),
    (
        "ungrouped-want-evicts-grouped",
        W("c", 2),
        [R("a", 2), R("b", 2, group="h")],
        4,
        {},
        Evict(("b",), "c"),
    ),
    (
        "other-group-coexisting-stays",
        W("c", 2, group="g", coexist_with=frozenset({"b"})),
        [R("b", 2, group="h")],
        6,
        {},
        Load("c"),
    ),
    (
        "other-group-busy-waits",
        W("c", 2, group="g"),
        [R("b", 2, group="h", leases=1)],
        6,
        {},
        Wait("", ("b",)),
    ),
    (
        "other-group-pinned-nofit",
        W("c", 2, group="g"),
        [R("b", 2, group="h", pinned=True)],
        6,
        {},
        NoFit(""),
    ),
    ("bigger-than-device", W("huge", 9), [], 8, {}, NoFit("")),
    (
        "pinned-hold-too-much",
        W("c", 5),
        [R("a", 4, pinned=True)],
        4,
        {},
        NoFit(""),
    ),
    (
        "max-loaded-forces-eviction",
        W("c", 1),
        [R("a", 1, last_used=5), R("b", 1, last_used=1)],
        6,
        {"max_loaded_models": 2},
        Evict(("b",), "c"),
    ),
    (
        "max-loaded-all-pinned-nofit",
        W("c", 1),
        [R("a", 1, pinned=True), R("b", 1, pinned=True)],
        6,
        {"max_loaded_models": 2},
        NoFit(""),
    ),
    (
        "minimal-victim-set",
        W("c", 5),
        [R("small", 1, last_used=1), R("big", 5, last_used=2)],
        2,
        {},
        Evict(("big",), "c"),
    ),
    (
        "two-when-needed",
        W("c", 6),
        [R("a", 3, last_used=1), R("b", 3, last_used=2), R("d", 1, last_used=3)],
        1,
        {},
        Evict(("a", "b"), "c"),
    ),
]


@pytest.mark.parametrize(
    ("want", "residents", "free_gib", "kw", "expected"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_plan(
    want: Want,
    residents: list[Resident],
    free_gib: float,
    kw: dict[str, int],
    expected: Decision,
) -> None:
    got = plan(want, residents, int(free_gib * GiB), TOTAL, **kw)
    if isinstance(expected, Wait):
        assert isinstance(got, Wait)
        assert got.blocked_by == expected.blocked_by
        assert all(m in got.reason for m in expected.blocked_by)
    elif isinstance(expected, NoFit):
        assert isinstance(got, NoFit)
        assert want.model in got.reason or "max_loaded_models" in got.reason
    else:
        assert got == expected


def test_nofit_reason_in_words() -> None:
    got = plan(W("huge", 9), [], 8 * GiB, TOTAL)
    assert got == NoFit("huge needs 9.0 GiB, the device has 8.0 GiB in all")


def test_wait_when_busy_names_only_what_is_needed() -> None:
    residents = [R("idle", 1, last_used=1), R("busy1", 4, leases=1), R("busy2", 4, leases=1)]
    got = plan(W("c", 4), residents, 0, TOTAL)
    assert isinstance(got, Wait)
    assert got.blocked_by == ("busy1",)


@pytest.mark.parametrize(
    ("resident", "now", "gone"),
    [
        (R("a", 1, last_used=0, keep_alive_s=300), 299, False),
        (R("a", 1, last_used=0, keep_alive_s=300), 300, True),
        (R("a", 1, last_used=0, keep_alive_s=0), 0, True),
        (R("a", 1, last_used=0, keep_alive_s=None), 1e9, False),
        (R("a", 1, last_used=0, keep_alive_s=0, leases=1), 10, False),
        (R("a", 1, last_used=0, keep_alive_s=0, pinned=True), 10, False),
        # A request waits to lease it (its load just finished): keep-alive 0 is "after it".
        (R("a", 1, last_used=0, keep_alive_s=0, waiters=1), 10, False),
    ],
    ids=["before-ttl", "at-ttl", "keep-alive-0", "forever", "leased", "pinned", "awaited"],
)
def test_expired(resident: Resident, now: float, gone: bool) -> None:
    assert expired([resident], now) == (("a",) if gone else ())


def test_a_model_requests_wait_to_lease_is_never_a_victim() -> None:
    residents = [R("awaited", 4, last_used=1, waiters=1), R("idle", 4, last_used=2)]
    assert plan(W("c", 4), residents, 0, TOTAL) == Evict(("idle",), "c")
    got = plan(W("c", 4), [R("awaited", 4, waiters=2)], 4 * GiB, TOTAL, max_loaded_models=1)
    assert isinstance(got, Wait) and got.blocked_by == ("awaited",)


# Loads waiting for memory are placed in arrival order: `ahead` are the earlier ones.
AHEAD: list[tuple[str, Want, list[Resident], float, list[str], type]] = [
    ("fits-but-behind", W("c", 1), [R("a", 4, leases=1)], 4, ["b"], Wait),
    ("evictable-but-behind", W("c", 4), [R("a", 4)], 0, ["b"], Wait),
    ("head-loads", W("b", 1), [R("a", 4, leases=1)], 4, [], Load),
    ("resident-needs-no-place", W("a", 4), [R("a", 4)], 4, ["b"], Ready),
    ("never-fits-says-so-at-once", W("huge", 9), [], 8, ["b"], NoFit),
    ("pinned-group-says-so-at-once", W("g", 1, group="x"), [R("p", 1, pinned=True, group="y")],
     7, ["b"], NoFit),
]


@pytest.mark.parametrize(
    ("want", "residents", "free_gib", "ahead", "kind"),
    [c[1:] for c in AHEAD],
    ids=[c[0] for c in AHEAD],
)
def test_loads_are_placed_in_arrival_order(
    want: Want, residents: list[Resident], free_gib: float, ahead: list[str], kind: type
) -> None:
    got = plan(want, residents, int(free_gib * GiB), TOTAL, ahead=ahead)
    assert isinstance(got, kind), got
    if isinstance(got, Wait):
        assert got.blocked_by == tuple(ahead) and "earlier loads" in got.reason
