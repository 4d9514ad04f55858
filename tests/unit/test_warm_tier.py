"""The warm tier's bookkeeping (engine/warm_tier.py) and the GGUF read-ahead's hint
(engine/read_ahead.py): pure decisions, as tables."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from modelyard.engine.read_ahead import read_ahead
from modelyard.engine.warm_tier import WarmEntry, WarmTier
from modelyard.placement import policy
from modelyard.placement.view import plan_from_status
from modelyard.wire.status import DeviceStatus, EngineStatus, ModelMemory, ModelStatus

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

GIB = 2**30


def entry(model: str, host_gib: float, device_gib: float = 0.0, fp: str = "v1") -> WarmEntry:
    return WarmEntry(model=model, fingerprint=fp, backend=None, host_bytes=int(host_gib * GIB),
                     device_bytes=int(device_gib * GIB), how="host", since=0.0)


def tier(budget_gib: float, *entries: WarmEntry) -> WarmTier:
    t = WarmTier(int(budget_gib * GIB), clock=lambda: 0.0)
    for e in entries:
        assert t.admit(e) == []
    return t


@pytest.mark.parametrize(("case", "budget", "host", "new", "free", "total", "admits"), [
    ("fits", 16, 4, 4, 40, 64, True),
    ("disabled", 0, 1, 1, 40, 64, False),
    ("bigger-than-budget", 16, 17, 17, 40, 64, False),
    ("would-cross-the-host-floor", 16, 4, 4, 9, 64, False),  # 9 - 4 < 6.4
    ("in-place-moves-nothing", 16, 4, 0, 9, 64, True),  # a CPU engine's module stays put
])
def test_what_may_enter(case: str, budget: int, host: int, new: int, free: int, total: int,
                        admits: bool) -> None:
    t = tier(budget)
    assert t.admits(host * GIB, new_host_bytes=new * GIB, host_free=free * GIB,
                    host_total=total * GIB) is admits, case


def test_the_least_recently_evicted_leave_first_when_the_budget_is_full() -> None:
    t = tier(10, entry("a", 4), entry("b", 4))
    dropped = t.admit(entry("c", 4))
    assert [e.model for e in dropped] == ["a"]
    assert [e.model for e in t] == ["b", "c"]
    assert t.host_bytes == 8 * GIB


def test_a_new_copy_of_a_model_replaces_its_old_one() -> None:
    t = tier(10, entry("a", 4, fp="old"))
    assert [e.fingerprint for e in t.admit(entry("a", 4, fp="new"))] == ["old"]
    assert [e.fingerprint for e in t] == ["new"]


def test_take_hands_back_only_the_same_spec() -> None:
    t = tier(10, entry("a", 4, fp="v1"))
    assert t.take("a", "v2") is None  # the spec changed: the caller drops it
    assert t.get("a") is not None
    taken = t.take("a", "v1")
    assert taken is not None and taken.model == "a"
    assert len(t) == 0 and t.take("a", "v1") is None


def test_reclaim_frees_device_memory_least_recent_first_and_spares_the_one_loading() -> None:
    t = tier(64, entry("a", 4, 4), entry("host-only", 4, 0), entry("b", 4, 4), entry("c", 4, 4))
    victims = t.reclaim(6 * GIB, keep="a")
    assert [e.model for e in victims] == ["b", "c"]  # a is kept, host-only frees no device
    assert [e.model for e in t] == ["a", "host-only"]
    assert t.reclaim(0) == []


def test_a_smaller_budget_drops_the_oldest() -> None:
    t = tier(12, entry("a", 4), entry("b", 4), entry("c", 4))
    assert [e.model for e in t.resize(5 * GIB)] == ["a", "b"]
    assert [e.model for e in t.resize(0)] == ["c"]


def test_a_warm_model_is_reported_only_while_stopped() -> None:
    t = tier(12, entry("a", 4, 1))
    reported = t.report(ModelStatus(model="a", state="stopped"))
    assert reported.warm == "host" and reported.memory.host_bytes == 4 * GIB
    assert t.report(ModelStatus(model="a", state="loading")).warm is None
    assert t.report(ModelStatus(model="b", state="stopped")).warm is None


def test_placement_counts_warm_device_memory_as_free() -> None:
    """A load that fits only once warm models give their memory back is a Load, not an
    eviction of a live model nor a NoFit, on the engine and in the front's prediction."""
    resident = ModelStatus(model="r", state="ready",
                           memory=ModelMemory(reserved_bytes=2 * GIB, measured_bytes=2 * GIB))
    device = DeviceStatus(total_bytes=8 * GIB, free_bytes=3 * GIB)
    want = policy.Want("w", 5 * GIB)
    cold = EngineStatus(device=device, models=(resident,))
    assert isinstance(plan_from_status(cold, want), policy.Evict)
    warm = EngineStatus(device=DeviceStatus(total_bytes=8 * GIB, free_bytes=3 * GIB,
                                            warm_bytes=3 * GIB), models=(resident,))
    assert plan_from_status(warm, want) == policy.Load("w")


def test_read_ahead_hints_each_file_that_fits_in_memory(tmp_path: Path) -> None:
    small, big, missing = tmp_path / "small.gguf", tmp_path / "big.gguf", tmp_path / "none"
    small.write_bytes(b"x" * 1000)
    big.write_bytes(b"x" * 5000)
    calls: list[tuple[str, int, int, int]] = []

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice))

    hinted = read_ahead([small, big, missing], fadvise, available_bytes=lambda: 4000)
    assert hinted == [small]
    assert calls == [(str(small), 0, 0, os.POSIX_FADV_WILLNEED)]
