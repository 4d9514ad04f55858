"""The multi-GPU scheduling simulator (bench/sched_multi.py, its policies in
bench/sched_multi_policies.py) keeps the engine's rules per device under every policy: no busy
or loading model is evicted, no device is overfilled, nothing is placed in host RAM, every
request is served or failed; and its baselines place as documented."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from bench import sched, sched_multi
from bench import sched_multi_policies as pol
from bench.sched import Request, SimulationError
from bench.sched_multi import GpuResult, GpuTrace
from bench.sched_multi_policies import GpuPolicy, Loaded, Place

from modelyard.placement import policy as scheduler
from modelyard.placement.devices import DeviceRoom, Placement
from modelyard.placement.policy import NoFit, Ready, Wait, Want

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

GiB = sched.GiB
TWO_24 = (24 * GiB, 24 * GiB)
N = 300


@pytest.fixture(scope="module")
def runs() -> list[tuple[GpuTrace, dict[str, GpuResult]]]:
    traces = [t for seed in range(2) for t in sched_multi.build_gpu_traces(seed, N, TWO_24)]
    return [(t, sched_multi.run_gpu_trace(t)) for t in traces]


def _trace(
    devices_gib: Sequence[int], models: dict[str, int], reqs: Sequence[tuple[float, str, float]]
) -> GpuTrace:
    return GpuTrace(
        "t", tuple(g * GiB for g in devices_gib), {m: g * GiB for m, g in models.items()},
        tuple(Request(*r) for r in reqs),
    )


def test_gpus_spec_parses_counts_and_sizes() -> None:
    assert sched_multi.parse_gpus("2x24GiB") == TWO_24
    assert sched_multi.parse_gpus("1x24GiB,2x16GiB") == (24 * GiB, 16 * GiB, 16 * GiB)
    assert sched_multi.parse_gpus("1x0.5GiB") == (GiB // 2,)
    for bad in ("24GiB", "2x24", "0x24GiB", "2x0GiB", "2x24GB"):
        with pytest.raises(ValueError, match="COUNTxSIZEGiB"):
            sched_multi.parse_gpus(bad)


def test_gpu_traces_are_deterministic_and_well_formed() -> None:
    for make in (sched_multi.big_mix_trace, sched_multi.hot_burst_trace):
        trace = make(3, N, TWO_24)
        assert trace == make(3, N, TWO_24)
        assert trace.requests != make(4, N, TWO_24).requests
        assert len(trace.requests) == N
        arrivals = [r.arrival_s for r in trace.requests]
        assert arrivals == sorted(arrivals)
        assert all(r.model in trace.model_bytes and r.service_s > 0 for r in trace.requests)
        assert max(trace.model_bytes.values()) <= trace.total_bytes


def test_big_mix_has_models_only_two_devices_hold() -> None:
    trace = sched_multi.big_mix_trace(0, N, TWO_24)
    too_big = {m for m, b in trace.model_bytes.items() if b > 24 * GiB}
    assert too_big == {"m3-30g", "m4-40g"}
    assert too_big & {r.model for r in trace.requests}


def test_hot_burst_is_mostly_the_hot_model() -> None:
    trace = sched_multi.hot_burst_trace(0, N, TWO_24)
    hot = sum(r.model == "hot-12g" for r in trace.requests)
    assert N * 0.6 < hot < N


def test_every_request_completes_or_fails_and_none_that_fit_is_refused(
    runs: list[tuple[GpuTrace, dict[str, GpuResult]]],
) -> None:
    for trace, results in runs:
        assert set(results) == {"modelyard", "ollama-like", "llama-swap-like"}
        for r in results.values():
            assert r.completed + r.failed == len(trace.requests), (trace.name, r.policy)
            assert (r.failed, r.refused_fit) == (0, 0), (trace.name, r.policy)
            assert len(r.delays) == r.completed and min(r.delays) >= 0
            assert 0 <= r.at_once <= r.completed


def test_no_device_is_ever_overcommitted(
    runs: list[tuple[GpuTrace, dict[str, GpuResult]]],
) -> None:
    for trace, results in runs:
        for r in results.values():
            assert r.peak_by_device, (trace.name, r.policy)
            for d, peak in r.peak_by_device.items():
                assert 0 < peak <= trace.device_bytes[d], (trace.name, r.policy, d)


def test_big_models_span_and_llama_swap_always_spans(
    runs: list[tuple[GpuTrace, dict[str, GpuResult]]],
) -> None:
    for trace, results in runs:
        assert results["llama-swap-like"].spans == results["llama-swap-like"].loads
        if trace.name == "big-mix":  # 30 and 40 GiB models can only load across both
            assert results["modelyard"].spans > 0 and results["ollama-like"].spans > 0


def test_modelyard_policy_is_the_real_plan_over_devices() -> None:
    rooms = [DeviceRoom(0, 24 * GiB, 24 * GiB), DeviceRoom(1, 24 * GiB, 24 * GiB)]
    big = pol.modelyard_plan(Want("big", 40 * GiB), [], rooms, 0.0)
    assert isinstance(big, Place) and big.placement.devices in ((0, 1), (1, 0))
    assert big.placement.bytes >= 40 * GiB
    small = pol.modelyard_plan(Want("small", 10 * GiB), [], rooms, 0.0)
    assert isinstance(small, Place) and len(small.placement.devices) == 1
    assert _gpu_policy("modelyard").plan is pol.modelyard_plan
    loaded = [Loaded("a", Placement.whole(0, 4 * GiB), 0, False, 0.0, 300.0, 3.0)]
    assert pol.modelyard_expired(loaded, 400.0) == scheduler.expired(
        pol._residents(loaded), 400.0) == ("a",)


def _gpu_policy(name: str) -> GpuPolicy:
    return {p.name: p for p in pol.gpu_policies()}[name]


def test_ollama_fit_takes_the_emptiest_gpu_else_spreads_by_free_memory() -> None:
    free = [(0, 8 * GiB), (1, 16 * GiB)]
    # Device 0 would hold it exactly (best fit); Ollama takes the emptiest, device 1.
    assert pol.ollama_fit(8 * GiB, free) == Placement.whole(1, 8 * GiB)
    spread = pol.ollama_fit(18 * GiB, free)
    assert spread is not None and spread.bytes == 18 * GiB
    assert spread.on(1) == 12 * GiB and spread.on(0) == 6 * GiB  # 16:8 of 18 GiB
    assert pol.ollama_fit(25 * GiB, free) is None


def test_split_by_free_is_exact_and_within_each_device() -> None:
    free = [(0, 7), (1, 11), (2, 13)]
    for n in range(32):
        p = pol.split_by_free(n, free)
        assert p is not None and p.bytes == n
        assert all(p.on(d) <= f for d, f in free)
    assert pol.split_by_free(32, free) is None


def test_ollama_like_waits_while_the_only_room_is_on_a_loading_gpu() -> None:
    loading = Loaded("a", Placement.whole(0, 4 * GiB), 1, True, 0.0, 300.0, 3.0)
    rooms = [DeviceRoom(0, 20 * GiB, 24 * GiB), DeviceRoom(1, 0, 24 * GiB)]
    assert isinstance(pol.ollama_plan(Want("b", 8 * GiB), [loading], rooms, 0.0), Wait)


def test_ollama_like_evicts_idle_in_expiry_order_until_it_fits() -> None:
    old = Loaded("old", Placement.whole(0, 20 * GiB), 0, False, 10.0, 300.0, 11.0)
    new = Loaded("new", Placement.whole(1, 20 * GiB), 0, False, 50.0, 300.0, 11.0)
    rooms = [DeviceRoom(0, 4 * GiB, 24 * GiB), DeviceRoom(1, 4 * GiB, 24 * GiB)]
    d = pol.ollama_plan(Want("c", 16 * GiB), [old, new], rooms, 60.0)
    assert d == Place("c", ("old",), Placement.whole(0, 16 * GiB))
    d = pol.ollama_plan(Want("c", 40 * GiB), [old, new], rooms, 60.0)
    assert isinstance(d, Place) and d.victims == ("old", "new") and d.placement.bytes == 40 * GiB


def _rogue(placement: Placement, evict: bool = False) -> GpuPolicy:
    """A policy that ignores leases and per-device memory: the simulator must refuse it."""

    def rogue_plan(
        want: Want, loaded: Sequence[Loaded], devices: Sequence[DeviceRoom], now: float
    ) -> Ready | Place | Wait | NoFit:
        if any(r.model == want.model for r in loaded):
            return Ready(want.model)
        victims = tuple(r.model for r in loaded) if evict else ()
        return Place(want.model, victims, placement)

    return GpuPolicy("rogue", rogue_plan, pol.ttl_expired, None, head_of_line=False)


def test_evicting_a_busy_model_raises() -> None:
    trace = _trace([24, 24], {"a": 10, "b": 10}, [(0, "a", 100), (1, "b", 1)])
    with pytest.raises(SimulationError, match=r"unloads a at t=1\.0 s with 1 requests"):
        sched_multi.simulate_gpus(trace, _rogue(Placement.whole(1, 10 * GiB), evict=True))


def test_overfilling_one_device_raises_though_the_node_has_room() -> None:
    trace = _trace([12, 12], {"a": 10, "b": 10}, [(0, "a", 1), (30, "b", 1)])
    with pytest.raises(SimulationError, match=r"needs 10\.0 GiB on device 0, 2\.0 GiB free"):
        sched_multi.simulate_gpus(trace, _rogue(Placement.whole(0, 10 * GiB)))


def test_placing_in_host_ram_or_short_raises() -> None:
    trace = _trace([24, 24], {"a": 10}, [(0, "a", 1)])
    offload = Placement(device_bytes=((0, 6 * GiB),), host_bytes=4 * GiB)
    with pytest.raises(SimulationError, match="in host RAM"):
        sched_multi.simulate_gpus(trace, _rogue(offload))
    with pytest.raises(SimulationError, match="unknown device 2"):
        sched_multi.simulate_gpus(trace, _rogue(Placement.whole(2, 10 * GiB)))


def test_a_spanning_victim_frees_both_devices_for_a_spanning_want() -> None:
    # a (40 GiB) spans both devices and serves until 21 + 10; b (40 GiB) loads only then.
    trace = _trace([24, 24], {"a": 40, "b": 40}, [(0, "a", 10), (1, "b", 1)])
    for name, r in sched_multi.run_gpu_trace(trace).items():
        assert (r.loads, r.spans, r.evictions) == (2, 2, 1), name
        assert r.delays == [pytest.approx(21.0), pytest.approx(31 + 21 - 1)], name


def test_a_model_bigger_than_the_node_is_failed_but_not_counted_as_fitting() -> None:
    trace = _trace([24, 24], {"a": 10, "huge": 60}, [(0, "a", 1), (1, "huge", 1)])
    for name, r in sched_multi.run_gpu_trace(trace).items():
        assert (r.completed, r.failed, r.refused_fit) == (1, 1, 0), name


def test_goals_compare_modelyard_with_ollama_like(
    runs: list[tuple[GpuTrace, dict[str, GpuResult]]],
) -> None:
    trace, results = runs[0]
    goals = sched_multi.gpu_goals(trace, results)
    assert [g["pass"] for g in goals] == [
        results["modelyard"].refused_fit == 0,
        results["modelyard"].bytes_loaded < results["ollama-like"].bytes_loaded,
    ]


def test_layer_profile_cuts_whole_layers_that_add_up() -> None:
    p = sched_multi.layer_profile(20 * GiB)
    assert p.layers == 40 and set(p.layer_bytes) == {sched_multi.LAYER_BYTES}
    assert p.bytes_on_one_device() == 20 * GiB
    odd = sched_multi.layer_profile(GiB + 1)
    assert odd.layer_bytes == (GiB // 2, GiB // 2, 1) and odd.bytes_on_one_device() == GiB + 1


def test_a_model_split_by_layers_uses_uneven_room_without_evicting() -> None:
    # a (10) and b (16) take one device each, leaving 14 + 8 GiB: c (20) fits across both only
    # in proportion to the room (by whole layers, from the profile), not split evenly (10 + 10).
    trace = _trace([24, 24], {"a": 10, "b": 16, "c": 20},
                   [(0, "a", 100), (1, "b", 100), (30, "c", 1)])
    results = sched_multi.run_gpu_trace(trace)
    for name in ("modelyard", "ollama-like"):
        r = results[name]
        assert (r.loads, r.evictions, r.spans, r.failed) == (3, 0, 1, 0), name
        assert r.delays[2] == pytest.approx(1 + 10), name  # c loads at once: 1 s + 20 GiB / 2
