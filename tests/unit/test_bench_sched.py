"""The scheduling simulator (bench/sched.py) keeps the engine's rules under every policy it
compares: no busy model is evicted, the device is never overfilled, every request is served or
failed, and the offline Belady bound is never beaten."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from bench import sched
from bench.sched import Policy, Request, Result, SimulationError, Trace

from modelyard.placement import policy as scheduler
from modelyard.placement.policy import Decision, Evict, Load, Ready, Resident, Want

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

GiB = sched.GiB
SEEDS = range(4)
N = 200


def _traces() -> list[Trace]:
    out: list[Trace] = []
    for seed in SEEDS:
        out += sched.build_traces(seed, N)
        out.append(sched.agent_trace(seed, N, agents=1))
    return out


@pytest.fixture(scope="module")
def runs() -> list[tuple[Trace, dict[str, Result]]]:
    return [(trace, sched.run_trace(trace)) for trace in _traces()]


def _policy(trace: Trace, name: str) -> Policy:
    return {p.name: p for p in sched.policies_for(trace)}[name]


def _trace(
    device_gib: int, models: dict[str, int], reqs: Sequence[tuple[float, str, float]]
) -> Trace:
    return Trace(
        "t", device_gib * GiB, {m: g * GiB for m, g in models.items()},
        tuple(Request(*r) for r in reqs),
    )


def test_traces_are_deterministic_and_well_formed() -> None:
    for make in (sched.agent_trace, sched.bursty_trace, sched.zipf_trace):
        trace = make(3, N)
        assert trace == make(3, N)
        assert trace.requests != make(4, N).requests
        assert len(trace.requests) == N
        arrivals = [r.arrival_s for r in trace.requests]
        assert arrivals == sorted(arrivals)
        assert all(r.model in trace.model_bytes and r.service_s > 0 for r in trace.requests)


def test_agent_models_fit_two_at_a_time_not_three() -> None:
    sizes = sorted(sched.AGENT_MODELS.values())
    assert sizes[-1] + sizes[-2] <= sched.DEVICE_BYTES < sum(sizes)


def test_every_request_completes_or_fails(runs: list[tuple[Trace, dict[str, Result]]]) -> None:
    for trace, results in runs:
        for r in results.values():
            assert r.completed + r.failed == len(trace.requests), (trace.name, r.policy)
            assert r.failed == 0  # every model fits the device on its own
            assert len(r.delays) == r.completed
            assert min(r.delays) >= 0


def test_memory_never_exceeds_the_device(runs: list[tuple[Trace, dict[str, Result]]]) -> None:
    for trace, results in runs:
        for r in results.values():
            assert 0 < r.peak_bytes <= trace.total_bytes, (trace.name, r.policy)


def test_belady_swaps_no_more_than_any_policy(
    runs: list[tuple[Trace, dict[str, Result]]],
) -> None:
    for trace, results in runs:
        lower = results["belady"].swaps
        for r in results.values():
            assert lower <= r.swaps, (trace.name, trace.params, r.policy)


def test_llama_swap_never_holds_two_models(runs: list[tuple[Trace, dict[str, Result]]]) -> None:
    for _, results in runs:
        assert results["llama-swap-like"].max_resident == 1
        assert results["ollama-like"].max_resident <= sched.OLLAMA_MAX_LOADED_MODELS


def test_modelyard_policy_is_the_real_scheduler() -> None:
    policy = _policy(sched.agent_trace(0, 10), "modelyard")
    assert policy.expired is scheduler.expired
    want = Want("c", 3 * GiB)
    residents = [Resident("a", 3 * GiB, last_used=20), Resident("b", 3 * GiB, last_used=10)]
    assert policy.plan(want, residents, 2 * GiB, 8 * GiB, 0.0) == scheduler.plan(
        want, residents, 2 * GiB, 8 * GiB
    )


def _rogue(decide: type[Load] | type[Evict]) -> Policy:
    """A policy that ignores leases and memory: the simulator must refuse to carry it out."""

    def rogue_plan(
        want: Want, residents: Sequence[Resident], free: int, total: int, now: float
    ) -> Decision:
        if any(r.model == want.model for r in residents):
            return Ready(want.model)
        if decide is Load or not residents:
            return Load(want.model)
        return Evict(tuple(r.model for r in residents), then_load=want.model)

    return Policy("rogue", rogue_plan, sched.ttl_expired, None, head_of_line=False)


def test_evicting_a_busy_model_raises() -> None:
    trace = _trace(12, {"a": 10, "b": 10}, [(0, "a", 100), (1, "b", 1)])
    with pytest.raises(SimulationError, match=r"unloads a at t=1\.0 s with 1 requests in flight"):
        sched.simulate(trace, _rogue(Evict))


def test_overfilling_the_device_raises() -> None:
    trace = _trace(12, {"a": 10, "b": 10}, [(0, "a", 1), (30, "b", 1)])
    with pytest.raises(SimulationError, match=r"loading b needs 10\.0 GiB, 2\.0 GiB free"):
        sched.simulate(trace, _rogue(Load))


def test_a_model_bigger_than_the_device_is_counted_failed() -> None:
    trace = _trace(24, {"a": 10, "huge": 30}, [(0, "a", 1), (1, "huge", 1), (2, "a", 1)])
    for name, r in sched.run_trace(trace).items():
        assert (r.completed, r.failed, r.loads) == (2, 1, 1), name


def test_a_want_blocked_by_a_busy_model_waits_for_its_release() -> None:
    # a loads in 1 + 10/2 = 6 s and serves until 56; b (1 + 20/2 = 11 s) can only load then.
    trace = _trace(24, {"a": 10, "b": 20}, [(0, "a", 50), (1, "b", 1)])
    for name, r in sched.run_trace(trace).items():
        assert r.delays == [pytest.approx(6.0), pytest.approx(56 + 11 - 1)], name
        assert (r.loads, r.evictions) == (2, 1), name


def test_keep_alive_unloads_an_idle_model_and_belady_never_does() -> None:
    # Served 3-4 s, expired at 304 s; reloaded for 1000 s, expired again at 1304 s.
    trace = _trace(24, {"a": 4}, [(0, "a", 1), (1000, "a", 1)])
    results = sched.run_trace(trace)
    assert (results["modelyard"].loads, results["modelyard"].ttl_unloads) == (2, 2)
    assert (results["ollama-like"].loads, results["ollama-like"].ttl_unloads) == (2, 2)
    assert (results["belady"].loads, results["belady"].swaps) == (1, 0)


def test_head_of_line_holds_later_requests_behind_a_waiting_swap() -> None:
    # b waits for busy a; the second a request joins a under modelyard, but queues behind b's
    # swap under llama-swap-like (its swap lock), costing a swap back.
    trace = _trace(12, {"a": 10, "b": 10}, [(0, "a", 20), (1, "b", 1), (2, "a", 1)])
    results = sched.run_trace(trace)
    assert results["modelyard"].loads == 2
    assert results["llama-swap-like"].loads == 3


def test_cli_writes_results_and_exits_zero(tmp_path: Path) -> None:
    out = tmp_path / "sched.json"
    assert sched.main(["--quick", "--seed", "5", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["traces"]) == {"agent", "bursty", "zipf"}
    assert all(len(t["results"]) == 4 for t in report["traces"].values())
    assert [t["pass"] in (True, False) for t in report["targets"]] == [True, True]
    # The multi-GPU traces (bench/sched_multi.py) run in quick mode too, on 2 x 24 GiB.
    assert set(report["gpu_traces"]) == {"big-mix", "hot-burst"}
    for t in report["gpu_traces"].values():
        assert t["device_gib"] == [24, 24]
        assert [r["policy"] for r in t["results"]] == ["modelyard", "ollama-like",
                                                       "llama-swap-like"]
        assert all(r["completed"] + r["failed"] == 300 for r in t["results"])
    assert len(report["gpu_goals"]) == 4
