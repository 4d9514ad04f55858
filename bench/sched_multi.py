"""The scheduling simulator on several devices: traces with models bigger than one GPU, replayed
on a simulated clock against the real ``plan(..., devices=[DeviceRoom, ...])`` and two
baselines. ``bench/sched.py`` runs these after its single-device traces (``--gpus 2x24GiB``).

Traces (default node: 2 x 24 GiB; arrivals fixed when the trace is built, open loop, as in
``bench/sched.py``):

* **big-mix**: Poisson arrivals at 0.05 req/s; each request picks one of five models of 8, 14,
  20, 30 and 40 GiB, the small ones more often (weights 35/25/20/12/8 %); service Exp(mean
  6 s), at least 0.5 s. Two models (30 and 40 GiB) only fit across both devices; the 8 and
  14 GiB ones fit one device together.
* **hot-burst**: one hot 12 GiB model gets bursts of 20-60 requests (Poisson, 1.2 req/s,
  service U(1,4) s) separated by Exp(mean 90 s); meanwhile background Poisson traffic (0.08
  req/s, service U(1,5) s) goes to five others of 6, 8, 10, 16 and 20 GiB, chosen uniformly.

Simulator: as ``bench/sched.py`` (a load takes 1 s + GiB / 2 GiB/s whatever the device count,
4 requests at once per model, unloads instant, keep-alive asked of the policy's ``expired()``),
but memory is per device: a placement puts bytes on a set of devices, and the simulator raises
:class:`~bench.sched.SimulationError` if a load overfills any device of its set, puts anything
in host RAM, places fewer bytes than the model has, or if a policy unloads a model that is
loading or has requests in flight or queued.

Policies: bench/sched_multi_policies.py (modelyard, ollama-like, llama-swap-like).

Metrics per policy: **at once** (requests whose service started on arrival: the model was
loaded and had a free slot), **GiB loaded**, **p95 wait** (service start - arrival),
**refused that fit** (requests refused for a model no bigger than the node's total memory),
loads, and **spans** (loads placed on more than one device). Goal: modelyard refuses none that
fit and loads fewer GiB than ollama-like.
"""

from __future__ import annotations

import heapq
import itertools
import random
import re
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from bench.sched import (
    Request,
    SimParams,
    SimulationError,
    _lane_rngs,
    _merge,
    _percentile,
)
from bench.sched_multi_policies import GpuPolicy, Loaded, Place, gpu_policies
from modelyard.placement.devices import DeviceRoom, LayerProfile, Placement
from modelyard.placement.policy import NoFit, Wait, Want

GiB = 1 << 30
DEFAULT_GPUS = "2x24GiB"
# A repeating layer of a 70B model at Q4 is about 0.5 GiB (40 GiB over 80 layers): every trace
# model is cut in such layers, so a split is by whole layers as llama.cpp's is.
LAYER_BYTES = GiB // 2

# --------------------------------------------------------------------------------------------
# Devices and traces


def parse_gpus(spec: str) -> tuple[int, ...]:
    """``2x24GiB`` → (24 GiB, 24 GiB); groups join with commas: ``1x24GiB,1x16GiB``."""
    sizes: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+(?:\.\d+)?)\s*GiB\s*", part)
        if m is None or int(m.group(1)) < 1 or float(m.group(2)) <= 0:
            raise ValueError(f"--gpus: {part!r} is not COUNTxSIZEGiB (e.g. 2x24GiB)")
        sizes += [int(float(m.group(2)) * GiB)] * int(m.group(1))
    return tuple(sizes)


@dataclass(frozen=True, slots=True)
class GpuTrace:
    name: str
    device_bytes: tuple[int, ...]  # device i has device_bytes[i]
    model_bytes: Mapping[str, int]
    requests: tuple[Request, ...]
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.device_bytes)


BIG_MIX_GIB = (8, 14, 20, 30, 40)
BIG_MIX_WEIGHTS = (0.35, 0.25, 0.20, 0.12, 0.08)
BIG_MIX_RATE = 0.05


def _big_mix_lane(rng: random.Random, names: Sequence[str]) -> Iterator[Request]:
    t = 0.0
    while True:
        t += rng.expovariate(BIG_MIX_RATE)
        model = rng.choices(names, BIG_MIX_WEIGHTS)[0]
        yield Request(t, model, max(0.5, rng.expovariate(1 / 6)))


def big_mix_trace(seed: int, n: int, devices: Sequence[int]) -> GpuTrace:
    rng = random.Random(seed)
    models = {f"m{i}-{g}g": g * GiB for i, g in enumerate(BIG_MIX_GIB)}
    lane = _big_mix_lane(random.Random(rng.randrange(2**32)), list(models))
    return GpuTrace("big-mix", tuple(devices), models, _merge([lane], n),
                    {"rate": BIG_MIX_RATE, "weights": list(BIG_MIX_WEIGHTS)})


HOT_GIB = 12
HOT_OTHERS_GIB = (6, 8, 10, 16, 20)
HOT_RATE = 1.2
HOT_GAP_MEAN_S = 90.0
BACKGROUND_RATE = 0.08


def _hot_lane(rng: random.Random, model: str) -> Iterator[Request]:
    t = 0.0
    while True:
        t += rng.expovariate(1 / HOT_GAP_MEAN_S)
        for _ in range(rng.randint(20, 60)):
            t += rng.expovariate(HOT_RATE)
            yield Request(t, model, rng.uniform(1.0, 4.0))


def _background_lane(rng: random.Random, names: Sequence[str]) -> Iterator[Request]:
    t = 0.0
    while True:
        t += rng.expovariate(BACKGROUND_RATE)
        yield Request(t, rng.choice(names), rng.uniform(1.0, 5.0))


def hot_burst_trace(seed: int, n: int, devices: Sequence[int]) -> GpuTrace:
    rng = random.Random(seed)
    hot = f"hot-{HOT_GIB}g"
    others = {f"o{i}-{g}g": g * GiB for i, g in enumerate(HOT_OTHERS_GIB)}
    hot_rng, bg_rng = _lane_rngs(rng, 2)
    lanes = [_hot_lane(hot_rng, hot), _background_lane(bg_rng, list(others))]
    return GpuTrace("hot-burst", tuple(devices), {hot: HOT_GIB * GiB, **others},
                    _merge(lanes, n),
                    {"hot": hot, "burst": [20, 60], "burst_rate": HOT_RATE,
                     "gap_mean_s": HOT_GAP_MEAN_S, "background_rate": BACKGROUND_RATE})


def build_gpu_traces(seed: int, n: int, devices: Sequence[int]) -> list[GpuTrace]:
    return [big_mix_trace(seed, n, devices), hot_burst_trace(seed, n, devices)]


def layer_profile(nbytes: int) -> LayerProfile:
    """``nbytes`` as whole layers of LAYER_BYTES (the rest in the last one); KV, embeddings and
    compute buffers are left out, so the profile's one-device total is ``nbytes`` exactly."""
    k, rest = divmod(nbytes, LAYER_BYTES)
    layers = (LAYER_BYTES,) * k if not rest else (LAYER_BYTES,) * k + (rest,)
    return LayerProfile(layer_bytes=layers, kv_bytes_per_layer=0, other_bytes=0,
                        compute_bytes_per_device=0)


# --------------------------------------------------------------------------------------------
# Simulator


@dataclass(slots=True)
class _Slot:
    model: str
    placement: Placement
    loading: bool
    last_used: float
    in_flight: int = 0
    queue: deque[Request] = field(default_factory=deque)

    @property
    def leases(self) -> int:
        return self.in_flight + len(self.queue)


@dataclass(slots=True)
class GpuResult:
    trace: str
    policy: str
    requests: int
    completed: int = 0
    failed: int = 0
    refused_fit: int = 0  # failed although the model is no bigger than the node
    at_once: int = 0
    loads: int = 0
    spans: int = 0
    bytes_loaded: int = 0
    evictions: int = 0
    ttl_unloads: int = 0
    peak_by_device: dict[int, int] = field(default_factory=dict)
    delays: list[float] = field(default_factory=list)

    def delay_pct(self, q: float) -> float:
        return _percentile(sorted(self.delays), q)

    def summary(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "requests": self.requests, "completed": self.completed,
            "failed": self.failed, "refused_that_fit": self.refused_fit,
            "served_at_once": self.at_once, "loads": self.loads, "spanning_loads": self.spans,
            "gib_loaded": self.bytes_loaded / GiB, "evictions": self.evictions,
            "ttl_unloads": self.ttl_unloads,
            "peak_gib_by_device": {str(d): b / GiB for d, b in self.peak_by_device.items()},
            "delay_p50_s": self.delay_pct(50), "delay_p95_s": self.delay_pct(95),
        }


_FINISH, _LOADED, _EXPIRE, _ARRIVE = range(4)


class GpuSimulation:
    """One multi-device trace under one policy on a simulated clock; ``run()`` once."""

    def __init__(self, trace: GpuTrace, policy: GpuPolicy,
                 params: SimParams = SimParams()) -> None:
        self.trace = trace
        self.policy = policy
        self.params = params
        self.now = 0.0
        self.slots: dict[str, _Slot] = {}
        self.result = GpuResult(trace.name, policy.name, len(trace.requests))
        self._events: list[tuple[float, int, int, Request | str]] = []
        self._seq = itertools.count()
        self._in_order: deque[Request] = deque()
        self._by_model: dict[str, deque[Request]] = {}

    def run(self) -> GpuResult:
        for req in self.trace.requests:
            self._push(req.arrival_s, _ARRIVE, req)
        while self._events:
            self.now, kind, _, payload = heapq.heappop(self._events)
            if isinstance(payload, Request):
                (self._in_order if self.policy.head_of_line
                 else self._by_model.setdefault(payload.model, deque())).append(payload)
            elif kind == _FINISH:
                self._finish(payload)
            elif kind == _LOADED:
                self.slots[payload].loading = False
                self._serve(self.slots[payload])
            else:
                for model in self.policy.expired(self._view(), self.now):
                    self._unload(model)
                    self.result.ttl_unloads += 1
            self._place()
        self._check_drained()
        return self.result

    def _push(self, at: float, kind: int, payload: Request | str) -> None:
        heapq.heappush(self._events, (at, kind, next(self._seq), payload))

    def used(self, device: int) -> int:
        return sum(s.placement.on(device) for s in self.slots.values())

    def rooms(self) -> list[DeviceRoom]:
        return [DeviceRoom(i, size - self.used(i), size)
                for i, size in enumerate(self.trace.device_bytes)]

    def _view(self) -> list[Loaded]:
        return [
            Loaded(s.model, s.placement, s.leases, s.loading, s.last_used,
                   self.policy.keep_alive_s, self.params.load_s(s.placement.bytes))
            for s in self.slots.values()
        ]

    def _place(self) -> None:
        if self.policy.head_of_line:
            while self._in_order:
                if not self._apply([self._in_order[0]]):
                    return
                self._in_order.popleft()
        else:
            for model in list(self._by_model):
                if self._apply(self._by_model[model]):
                    del self._by_model[model]

    def _apply(self, reqs: Sequence[Request]) -> bool:
        """Ask the policy for ``reqs`` (one model) and carry it out; False if they must wait."""
        model = reqs[0].model
        nbytes = self.trace.model_bytes[model]
        want = Want(model, nbytes, profile=layer_profile(nbytes))  # as a GGUF's tensors give it
        decision = self.policy.plan(want, self._view(), self.rooms(), self.now)
        if isinstance(decision, Wait):
            return False
        if isinstance(decision, NoFit):
            self.result.failed += len(reqs)
            if want.bytes <= self.trace.total_bytes:
                self.result.refused_fit += len(reqs)
            return True
        if isinstance(decision, Place):
            if decision.model != model or model in self.slots:
                raise SimulationError(f"{self.policy.name}: {decision} for a request for {model}")
            for victim in decision.victims:
                self._unload(victim)
                self.result.evictions += 1
            self._start_load(want, decision.placement)
        slot = self.slots.get(model)
        if slot is None:
            raise SimulationError(f"{self.policy.name}: {decision} but {model} is not resident")
        slot.queue.extend(reqs)
        self._serve(slot)
        return True

    def _start_load(self, want: Want, placement: Placement) -> None:
        name = self.policy.name
        if placement.host_bytes or placement.bytes < want.bytes:
            raise SimulationError(
                f"{name}: places {placement.bytes / GiB:.1f} GiB of {want.model} "
                f"({want.bytes / GiB:.1f} GiB) on devices, {placement.host_bytes} B in host RAM"
            )
        for d, nbytes in placement.device_bytes:
            if not 0 <= d < len(self.trace.device_bytes):
                raise SimulationError(f"{name}: places {want.model} on unknown device {d}")
            free = self.trace.device_bytes[d] - self.used(d)
            if nbytes > free:
                raise SimulationError(
                    f"{name}: loading {want.model} needs {nbytes / GiB:.1f} GiB on device {d}, "
                    f"{free / GiB:.1f} GiB free"
                )
        self.slots[want.model] = _Slot(want.model, placement, loading=True, last_used=self.now)
        res = self.result
        res.loads += 1
        res.spans += len(placement.devices) > 1
        res.bytes_loaded += placement.bytes
        for d in placement.devices:
            res.peak_by_device[d] = max(res.peak_by_device.get(d, 0), self.used(d))
        self._push(self.now + self.params.load_s(placement.bytes), _LOADED, want.model)

    def _unload(self, model: str) -> None:
        slot = self.slots.get(model)
        if slot is None:
            raise SimulationError(f"{self.policy.name}: unloads {model}, which is not resident")
        if slot.loading or slot.leases:
            raise SimulationError(
                f"{self.policy.name}: unloads {model} at t={self.now:.1f} s with "
                f"{slot.leases} requests in flight or queued (loading={slot.loading})"
            )
        del self.slots[model]

    def _serve(self, slot: _Slot) -> None:
        if slot.loading:
            return
        while slot.queue and slot.in_flight < self.params.concurrency:
            req = slot.queue.popleft()
            slot.in_flight += 1
            delay = self.now - req.arrival_s
            self.result.delays.append(delay)
            self.result.at_once += delay <= 1e-9
            self._push(self.now + req.service_s, _FINISH, slot.model)

    def _finish(self, model: str) -> None:
        slot = self.slots[model]
        slot.in_flight -= 1
        slot.last_used = self.now
        self.result.completed += 1
        self._serve(slot)
        if not slot.leases and self.policy.keep_alive_s is not None:
            self._push(self.now + self.policy.keep_alive_s, _EXPIRE, model)

    def _check_drained(self) -> None:
        res = self.result
        waiting = len(self._in_order) + sum(len(q) for q in self._by_model.values())
        leased = sum(s.leases for s in self.slots.values())
        if waiting or leased or res.completed + res.failed != res.requests:
            raise SimulationError(
                f"{self.policy.name}: {res.completed} done + {res.failed} failed of "
                f"{res.requests}; {waiting} still waiting, {leased} leased"
            )


def simulate_gpus(trace: GpuTrace, policy: GpuPolicy,
                  params: SimParams = SimParams()) -> GpuResult:
    return GpuSimulation(trace, policy, params).run()


def run_gpu_trace(trace: GpuTrace, params: SimParams = SimParams()) -> dict[str, GpuResult]:
    return {p.name: simulate_gpus(trace, p, params) for p in gpu_policies()}


# --------------------------------------------------------------------------------------------
# Report


def _gpus_label(devices: Sequence[int]) -> str:
    return " + ".join(f"{b / GiB:g}" for b in devices) + " GiB"


def render_gpu_table(trace: GpuTrace, results: Mapping[str, GpuResult]) -> Table:
    sizes = ", ".join(f"{m} {b / GiB:g}" for m, b in trace.model_bytes.items())
    table = Table(
        title=f"{trace.name}: {len(trace.requests)} requests over "
        f"{trace.requests[-1].arrival_s / 3600:.1f} h on {_gpus_label(trace.device_bytes)}",
        caption=f"models (GiB): {sizes}\nno wait: served on arrival; refused, fit: refused though "
        "the model fits the node's total; spans: loads over more than one device",
        title_justify="left", caption_justify="left",
    )
    table.add_column("policy", no_wrap=True)
    for col in ("requests", "no wait", "refused, fit", "failed", "loads", "spans", "GiB loaded",
                "p50 wait s", "p95 wait s", "GiB/ollama"):
        table.add_column(col, justify="right")
    base = results["ollama-like"].bytes_loaded
    for r in results.values():
        table.add_row(
            r.policy, str(r.requests), str(r.at_once), str(r.refused_fit), str(r.failed),
            str(r.loads), str(r.spans), f"{r.bytes_loaded / GiB:.0f}",
            f"{r.delay_pct(50):.2f}", f"{r.delay_pct(95):.2f}",
            f"{r.bytes_loaded / base:.2f}" if base else "n/a",
        )
    return table


def gpu_goals(trace: GpuTrace, results: Mapping[str, GpuResult]) -> list[dict[str, Any]]:
    """The issue's goals: modelyard refuses none that fit, loads fewer GiB than ollama-like."""
    mine, ollama = results["modelyard"], results["ollama-like"]
    return [
        {"trace": trace.name, "target": "modelyard refuses no request that fits the node",
         "modelyard": mine.refused_fit, "bound": 0, "pass": mine.refused_fit == 0},
        {"trace": trace.name, "target": "modelyard GiB loaded < ollama-like's",
         "modelyard": mine.bytes_loaded / GiB, "bound": ollama.bytes_loaded / GiB,
         "pass": mine.bytes_loaded < ollama.bytes_loaded},
    ]
