"""front.routing.view_from_status: the engine's own policy run on its /status snapshot."""

from __future__ import annotations

from typing import Any

import pytest

from modelyard.front.dispatch import routing
from modelyard.front.dispatch.routing import EngineView, pick_engine
from modelyard.placement.policy import Want
from modelyard.wire.status import EngineStatus

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

GiB = 2**30
TOTAL = 8 * GiB


def view_from_status(
    name: str, status: dict[str, Any], want: Want, queued: int = 0
) -> EngineView:
    """routing.view_from_status on a canned /status body, decoded as the engine client does."""
    return routing.view_from_status(name, EngineStatus.from_json(status), want, queued)


def M(
    model: str,
    gib: float | None,
    *,
    state: str = "ready",
    leases: int = 0,
    last_used: float = 0.0,
    reserved_gib: float | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """One entry of `Engine.status()["models"]`: `gib` is what a load measured."""
    measured = int(gib * GiB) if gib is not None else None
    reserved = int(reserved_gib * GiB) if reserved_gib is not None else measured
    return {
        "model": model,
        "backend": "openai",
        "state": state,
        "pid": 4242 if state in ("ready", "loading") else None,
        "leases": leases,
        "pinned": kw.get("pinned", False),
        "priority": kw.get("priority", 0),
        "last_used": last_used,
        "group": kw.get("group"),
        "memory": {
            "estimate_bytes": reserved,
            "reserved_bytes": reserved if state in ("ready", "loading") else None,
            "measured_bytes": measured if state in ("ready", "loading") else None,
            "host_bytes": None,
        },
    }


def S(
    models: list[dict[str, Any]],
    free_gib: float,
    total_gib: float = TOTAL / GiB,
    max_loaded_models: int | None = None,
) -> dict[str, Any]:
    """An `Engine.status()` snapshot."""
    total, free = int(total_gib * GiB), int(free_gib * GiB)
    return {
        "engine": 0,
        "pid": 4000,
        "device": {
            "kind": "simulated",
            "name": "simulated GPU 0",
            "total_bytes": total,
            "used_bytes": total - free,
            "free_bytes": free,
            "temperature_c": None,
            "reserved_loading_bytes": 0,
        },
        "paused": None,
        "scheduler": {"max_loaded_models": max_loaded_models, "loads": 0},
        "models": models,
    }


def W(model: str, gib: float, **kw: Any) -> Want:
    return Want(model, int(gib * GiB), **kw)


CASES: list[tuple[str, dict[str, Any], Want, bool, int, frozenset[str]]] = [
    ("empty-device", S([], 8), W("c", 3), True, 0, frozenset()),
    ("fits", S([M("a", 2)], 6), W("c", 3), True, 0, frozenset({"a"})),
    ("already-resident", S([M("c", 3)], 5), W("c", 3), True, 0, frozenset({"c"})),
    (
        "one-idle-eviction",
        S([M("a", 3, last_used=10), M("b", 3, last_used=20)], 2),
        W("c", 3),
        True, 1, frozenset({"a", "b"}),
    ),
    (
        "two-idle-evictions",
        S([M("a", 3, last_used=10), M("b", 3, last_used=20)], 2),
        W("c", 7),
        True, 2, frozenset({"a", "b"}),
    ),
    (
        "busy-only",
        S([M("a", 3, leases=1), M("b", 3, leases=2)], 2),
        W("c", 3),
        True, routing.BUSY_EVICTIONS, frozenset({"a", "b"}),
    ),
    (
        "idle-one-before-busy-one",
        S([M("a", 3, leases=1), M("b", 3)], 2),
        W("c", 3),
        True, 1, frozenset({"a", "b"}),
    ),
    (
        # a loading model counts as busy: it is never a victim
        "loading-is-busy",
        S([M("a", None, state="loading", reserved_gib=6)], 2),
        W("c", 3),
        True, routing.BUSY_EVICTIONS, frozenset({"a"}),
    ),
    (
        "pinned-never-a-victim",
        S([M("a", 3, pinned=True), M("b", 3)], 2),
        W("c", 3),
        True, 1, frozenset({"a", "b"}),
    ),
    (
        "pinned-holds-too-much",
        S([M("a", 6, pinned=True)], 2),
        W("c", 3),
        False, 0, frozenset({"a"}),
    ),
    ("bigger-than-the-device", S([], 8), W("c", 9), False, 0, frozenset()),
    (
        "max-loaded-models",
        S([M("a", 1)], 7, max_loaded_models=1),
        W("c", 1),
        True, 1, frozenset({"a"}),
    ),
    (
        "other-group-swaps-out",
        S([M("a", 1, group="g1")], 7),
        W("c", 1, group="g2"),
        True, 1, frozenset({"a"}),
    ),
    (
        # stopped, failed and stopping models are not resident and hold nothing to evict
        "only-ready-and-loading-are-resident",
        S(
            [
                M("a", 2),
                M("b", None, state="loading", reserved_gib=2),
                M("c", None, state="stopped"),
                M("d", None, state="failed"),
                M("e", 2, state="stopping"),
            ],
            2,
        ),
        # b's 2 GiB are promised but not yet on the device: f must evict a (as the engine would)
        W("f", 2),
        True, 1, frozenset({"a", "b"}),
    ),
    (
        "stopped-model-is-not-ready",
        S([M("c", None, state="stopped")], 8),
        W("c", 3),
        True, 0, frozenset(),
    ),
]


@pytest.mark.parametrize(
    ("status", "want", "compatible", "evictions", "resident"),
    [pytest.param(*c[1:], id=c[0]) for c in CASES],
)
def test_view_from_status(
    status: dict[str, Any], want: Want, compatible: bool, evictions: int, resident: frozenset[str]
) -> None:
    view = view_from_status("engine-0", status, want, queued=4)
    assert view == EngineView(
        "engine-0", up=True, compatible=compatible, resident=resident,
        evictions_needed=evictions, queued=4,
    )


def test_view_from_a_minimal_snapshot() -> None:
    """An engine that has not reported its device yet has room for nothing."""
    view = view_from_status("engine-0", {}, W("c", 1))
    assert (view.compatible, view.resident, view.evictions_needed) == (False, frozenset(), 0)


def test_an_engine_without_the_files_ranks_after_one_with_them() -> None:
    """An engine reports the catalog's models whose files its node lacks (no shared
    storage): a cold model goes to one that holds them, even one that must evict."""
    want = W("cold", 5)
    lacking = {**EMPTY, "missing_files": ["cold", "other"]}
    views = [view_from_status("engine-0", lacking, want),
             view_from_status("engine-1", IDLE_2, want, queued=3)]
    assert [v.has_files for v in views] == [False, True]
    assert pick_engine(views, "cold") == "engine-1"
    other = view_from_status("engine-0", lacking, W("a", 1))
    assert other.has_files  # what it lacks is named: another model is not


# --- with pick_engine: a cold model on two engines -------------------------------------------

IDLE_2 = S([M("a", 3, last_used=10), M("b", 3, last_used=20)], 2)  # needs 1 eviction for 5 GiB
IDLE_1 = S([M("a", 3, last_used=10), M("b", 2, last_used=20)], 3)  # needs 1 eviction for 5 GiB
FULL = S([M("c", 4), M("d", 4)], 0)  # needs 2 evictions for 5 GiB
BUSY = S([M("e", 4, leases=1), M("f", 4, leases=1)], 0)  # only busy models could make room
EMPTY = S([], 8)
SMALL = S([], 4, total_gib=4)  # 5 GiB never fits


@pytest.mark.parametrize(
    ("status0", "queued0", "status1", "queued1", "expected"),
    [
        pytest.param(IDLE_2, 9, FULL, 0, "engine-0", id="fewer-evictions-beats-less-queued"),
        pytest.param(FULL, 0, IDLE_2, 9, "engine-1", id="fewer-evictions-either-side"),
        pytest.param(IDLE_2, 3, IDLE_1, 1, "engine-1", id="tie-broken-by-queued"),
        pytest.param(IDLE_1, 1, IDLE_2, 3, "engine-0", id="tie-broken-by-queued-either-side"),
        pytest.param(BUSY, 0, FULL, 5, "engine-1", id="two-evictions-beat-waiting-on-busy"),
        pytest.param(EMPTY, 7, IDLE_2, 0, "engine-0", id="no-eviction-beats-one"),
        pytest.param(SMALL, 0, BUSY, 9, "engine-1", id="too-small-never-chosen"),
        pytest.param(SMALL, 0, SMALL, 0, None, id="nowhere-fits"),
    ],
)
def test_cold_model_goes_where_it_evicts_least(
    status0: dict[str, Any], queued0: int, status1: dict[str, Any], queued1: int,
    expected: str | None,
) -> None:
    want = W("cold", 5)
    views = [
        view_from_status("engine-0", status0, want, queued=queued0),
        view_from_status("engine-1", status1, want, queued=queued1),
    ]
    assert pick_engine(views, "cold") == expected


def test_resident_engine_wins_over_an_empty_one() -> None:
    want = W("a", 3)
    views = [
        view_from_status("engine-0", EMPTY, want, queued=0),
        view_from_status("engine-1", IDLE_2, want, queued=9),
    ]
    assert pick_engine(views, "a") == "engine-1"


def test_a_loading_models_pending_reservation_is_not_free() -> None:
    # A real GPU while `a` loads: promised 6 GiB, 1 GiB allocated so far, so the device still
    # reports 7 GiB free. The engine plans with 7 - (6 - 1) = 2 GiB and `a` is busy: Wait.
    loading = S([M("a", 1, state="loading", reserved_gib=6)], 7)
    view = view_from_status("engine-0", loading, W("c", 3))
    assert view.evictions_needed == routing.BUSY_EVICTIONS
    # so a cold model goes to the engine that can make room now
    views = [view, view_from_status("engine-1", IDLE_2, W("c", 3), queued=5)]
    assert pick_engine(views, "c") == "engine-1"
