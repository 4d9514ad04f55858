"""How many model loads modelyard's placement policy costs: request traces replayed on a simulated
clock against the real ``plan()``/``expired()`` and three baselines, in the same simulator.

    make bench-sched                          # 3 traces x 2000 requests, a few seconds
    .venv/bin/python bench/sched.py --quick --seed 7 --out /tmp/sched.json

Traces are built from ``random.Random(seed)`` (each lane from its own sub-seed, so lanes do not
disturb each other) and replayed open loop: arrival times are fixed when the trace is built, as if
every call were served at once, so a slow policy delays requests but does not slow its clients.
A policy that cannot keep up (llama-swap-like: a swap per alternation costs more than the think
gaps) builds a backlog, so its delays grow with the trace; its swaps stay the model changes in
arrival order, as they would be closed loop.

* **agent**: two coding agents (lanes, ``--agents``) working at once, each running sessions back
  to back. A session is 8-30 steps; a step is a planner call (service U(2,6) s) then a coder call
  (U(4,12) s); after either, with p=0.1, a tool-model call (U(0.2,1) s). Every call is followed
  by a think/tool-execution gap U(0.5,4) s; between sessions an agent pauses Exp(mean 120 s)
  (about 8 % of pauses outlast the 300 s keep-alive). Models: planner 9 GiB, coder 12 GiB,
  tool 4 GiB on a 24 GiB device: any two fit, all three (25 GiB) do not, so a memory-aware
  policy keeps two resident and swaps only around tool calls, while an exclusive swap reloads
  on every alternation.
* **bursty**: six tenants, each idle for Exp(mean 180 s), then bursting 10-40 requests
  (Poisson, 1.5 req/s, service U(0.5,3) s) at one model: its own with p=0.8, else any.
  Models of 4, 6, 8, 10, 12 and 14 GiB (one per tenant) on a 24 GiB device.
* **zipf**: Poisson arrivals at 0.25 req/s; the model drawn with Zipf popularity (s=1.1) over
  ten models of 2, 3, 4, 5, 6, 8, 9, 10, 12 and 14 GiB (popularity ranks shuffled against
  sizes by the seed); service Exp(mean 4 s), at least 0.2 s. 24 GiB device.

Simulator: one device; a load takes 1 s + bytes / 2 GiB/s and holds the model's memory from its
start; unloads are instant. Each model serves 4 requests at once, extras wait FIFO. A request
holds a lease from the moment it is attached to a model (waiting for its load or for a slot)
until it finishes, so a model with leases is busy and must never be evicted: the simulator raises
:class:`SimulationError` if a policy tries, or loads past the device's memory. When a model goes
idle, the policy's ``expired()`` is asked keep-alive seconds later. A request's queueing delay is
the start of its service minus its arrival (load time and waiting included).

Policies:

* **modelyard**: the real ``plan()``/``expired()``, memory decides (``max_loaded_models`` unset),
  keep-alive 300 s (the server default). Requests for a resident model are never held behind a
  request waiting for room (each request awaits its own model).
* **ollama-like**: at most 3 models (OLLAMA_MAX_LOADED_MODELS' default for one GPU), keep-alive
  300 s; to make room it unloads idle models in order of keep-alive expiry, one at a time until
  the new one fits (nothing spared), and waits if only busy models could make room. Requests are
  placed strictly in arrival order, as Ollama's scheduler does (``processPending`` blocks later
  requests, even for loaded models, until the head request runs).
* **llama-swap-like**: exclusive swap, one model at a time, no TTL (llama-swap's default).
  Head-of-line like llama-swap's swap lock: a request for another model waits until the current
  one has no request in flight, and requests behind it wait too.
* **belady**: offline lower bound with modelyard's memory model: on a needed eviction it unloads
  the idle residents whose next request in the trace is furthest away (then spares any it did
  not need), and never unloads on a timer (a keep-alive can only add loads). Furthest-next-use
  is optimal for equal sizes; with mixed sizes it is a heuristic, so "lower bound" is checked
  (tests/unit/test_bench_sched.py), not proven.

Metrics: **loads** counts every load, each model's first included; **swaps** = loads - distinct
models loaded (the loads a bigger device would have avoided). Results are printed per trace and
written to bench/results/sched-<timestamp>.json. Targets (agent trace): modelyard's swaps
<= 1.3x Belady's and <= 0.5x llama-swap-like's. With ``--agents 1`` the planner/coder
alternation is LRU's worst case (the least recently used of the pair is the one needed next),
so modelyard's recency-first victim order lands near 1.5x Belady there.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import random
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

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

GiB = 1 << 30
ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
DEVICE_BYTES = 24 * GiB
KEEP_ALIVE_S = 300.0
OLLAMA_MAX_LOADED_MODELS = 3
TARGET_VS_BELADY = 1.3
TARGET_VS_LLAMA_SWAP = 0.5


# --------------------------------------------------------------------------------------------
# Traces


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float
    model: str
    service_s: float


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    total_bytes: int
    model_bytes: Mapping[str, int]
    requests: tuple[Request, ...]
    params: Mapping[str, Any] = field(default_factory=dict)


def _merge(lanes: Iterable[Iterator[Request]], n: int) -> tuple[Request, ...]:
    """The first ``n`` requests of endless, time-ordered lanes, in arrival order."""
    return tuple(itertools.islice(heapq.merge(*lanes, key=lambda r: r.arrival_s), n))


def _lane_rngs(rng: random.Random, k: int) -> list[random.Random]:
    # One generator per lane: how far the merge reads one lane never shifts another's draws.
    return [random.Random(rng.randrange(2**32)) for _ in range(k)]


AGENT_MODELS = {"planner": 9 * GiB, "coder": 12 * GiB, "tool": 4 * GiB}
AGENT_STEPS = (("planner", 2.0, 6.0), ("coder", 4.0, 12.0))
TOOL_P = 0.1


def _agent_lane(rng: random.Random, start_s: float) -> Iterator[Request]:
    t = start_s
    while True:
        for _ in range(rng.randint(8, 30)):
            for model, lo, hi in AGENT_STEPS:
                calls = [(model, lo, hi)]
                if rng.random() < TOOL_P:
                    calls.append(("tool", 0.2, 1.0))
                for name, c_lo, c_hi in calls:
                    service = rng.uniform(c_lo, c_hi)
                    yield Request(t, name, service)
                    t += service + rng.uniform(0.5, 4.0)  # the next call needs this answer
        t += rng.expovariate(1 / 120)


def agent_trace(seed: int, n: int, agents: int = 2) -> Trace:
    rng = random.Random(seed)
    lanes = [
        _agent_lane(r, start_s=i * rng.uniform(0, 60))  # the first agent starts the trace
        for i, r in enumerate(_lane_rngs(rng, agents))
    ]
    return Trace("agent", DEVICE_BYTES, AGENT_MODELS, _merge(lanes, n),
                 {"agents": agents, "tool_p": TOOL_P, "session_pause_mean_s": 120})


BURSTY_GIB = (4, 6, 8, 10, 12, 14)


def _tenant_lane(rng: random.Random, home: str, models: Sequence[str]) -> Iterator[Request]:
    t = 0.0
    while True:
        t += rng.expovariate(1 / 180)
        model = home if rng.random() < 0.8 else rng.choice(models)
        for _ in range(rng.randint(10, 40)):
            t += rng.expovariate(1.5)
            yield Request(t, model, rng.uniform(0.5, 3.0))


def bursty_trace(seed: int, n: int) -> Trace:
    rng = random.Random(seed)
    models = {f"b{i}-{g}g": g * GiB for i, g in enumerate(BURSTY_GIB)}
    names = list(models)
    lanes = [_tenant_lane(r, names[i], names) for i, r in enumerate(_lane_rngs(rng, len(names)))]
    return Trace("bursty", DEVICE_BYTES, models, _merge(lanes, n),
                 {"tenants": len(names), "off_mean_s": 180, "burst": [10, 40], "rate": 1.5})


ZIPF_GIB = (2, 3, 4, 5, 6, 8, 9, 10, 12, 14)
ZIPF_S = 1.1
ZIPF_RATE = 0.25


def _zipf_lane(
    rng: random.Random, names: Sequence[str], weights: Sequence[float]
) -> Iterator[Request]:
    t = 0.0
    while True:
        t += rng.expovariate(ZIPF_RATE)
        yield Request(t, rng.choices(names, weights)[0], max(0.2, rng.expovariate(1 / 4)))


def zipf_trace(seed: int, n: int) -> Trace:
    rng = random.Random(seed)
    models = {f"z{i}-{g}g": g * GiB for i, g in enumerate(ZIPF_GIB)}
    ranked = list(models)
    rng.shuffle(ranked)  # popularity is not tied to size
    weights = [1 / k**ZIPF_S for k in range(1, len(ranked) + 1)]
    lane = _zipf_lane(random.Random(rng.randrange(2**32)), ranked, weights)
    return Trace("zipf", DEVICE_BYTES, models, _merge([lane], n),
                 {"s": ZIPF_S, "rate": ZIPF_RATE, "by_popularity": ranked})


def build_traces(seed: int, n: int, agents: int = 2) -> list[Trace]:
    return [agent_trace(seed, n, agents), bursty_trace(seed, n), zipf_trace(seed, n)]


# --------------------------------------------------------------------------------------------
# Policies: plan-shaped functions, (want, residents, free_bytes, total_bytes, now) -> Decision


PlanFn = Callable[[Want, Sequence[Resident], int, int, float], Decision]
ExpireFn = Callable[[Sequence[Resident], float], tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    plan: PlanFn
    expired: ExpireFn
    keep_alive_s: float | None
    head_of_line: bool  # place requests strictly in arrival order (see the module docstring)


def modelyard_plan(
    want: Want, residents: Sequence[Resident], free_bytes: int, total_bytes: int, now: float
) -> Decision:
    return plan(want, residents, free_bytes, total_bytes)


def _fits(want: Want, victims: Sequence[Resident], n: int, free: int, cap: int | None) -> bool:
    room = free + sum(v.bytes for v in victims) >= want.bytes
    return room and (cap is None or n - len(victims) + 1 <= cap)


def _prefix(
    want: Want, ordered: Sequence[Resident], n: int, free: int, cap: int | None
) -> list[Resident] | None:
    """The shortest prefix of ``ordered`` whose eviction makes room, or None."""
    chosen: list[Resident] = []
    for r in ordered:
        if _fits(want, chosen, n, free, cap):
            break
        chosen.append(r)
    return chosen if _fits(want, chosen, n, free, cap) else None


def _go(want: Want, victims: Sequence[Resident]) -> Decision:
    if not victims:
        return Load(want.model)
    return Evict(tuple(v.model for v in victims), then_load=want.model)


def _blocked(want: Want, residents: Sequence[Resident], free: int, cap: int | None) -> Decision:
    """No idle victims suffice: wait for the busy ones if evicting everything would do."""
    if _fits(want, residents, len(residents), free, cap):
        busy = tuple(r.model for r in residents if r.leases > 0)
        return Wait(f"{want.model} waits for busy {', '.join(busy)}", blocked_by=busy)
    return NoFit(f"{want.model} cannot fit")


def _settled(want: Want, residents: Sequence[Resident], total: int) -> Decision | None:
    """The answers every policy shares: already resident, or bigger than the device."""
    if any(r.model == want.model for r in residents):
        return Ready(want.model)
    if want.bytes > total:
        return NoFit(f"{want.model} is bigger than the device")
    return None


def ollama_plan(
    want: Want,
    residents: Sequence[Resident],
    free_bytes: int,
    total_bytes: int,
    now: float,
    *,
    max_loaded_models: int = OLLAMA_MAX_LOADED_MODELS,
) -> Decision:
    if (settled := _settled(want, residents, total_bytes)) is not None:
        return settled

    def expires_at(r: Resident) -> float:
        return r.last_used + (r.keep_alive_s if r.keep_alive_s is not None else float("inf"))

    # Ollama unloads one runner at a time, the idle one expiring soonest, and retries until the
    # new one fits: a prefix of that order with nothing spared.
    idle = sorted((r for r in residents if r.leases == 0), key=expires_at)
    victims = _prefix(want, idle, len(residents), free_bytes, max_loaded_models)
    if victims is None:
        return _blocked(want, residents, free_bytes, max_loaded_models)
    return _go(want, victims)


def llama_swap_plan(
    want: Want, residents: Sequence[Resident], free_bytes: int, total_bytes: int, now: float
) -> Decision:
    if (settled := _settled(want, residents, total_bytes)) is not None:
        return settled
    busy = tuple(r.model for r in residents if r.leases > 0)
    if busy:
        return Wait(f"{want.model} waits for {busy[0]} to finish", blocked_by=busy)
    return _go(want, residents)  # exclusive: whatever is loaded goes, even if both would fit


def belady_plan_for(trace: Trace) -> PlanFn:
    """Belady's plan for ``trace``: it reads the future, so it is bound to one trace."""
    arrivals: dict[str, list[float]] = defaultdict(list)
    for req in trace.requests:  # already in arrival order
        arrivals[req.model].append(req.arrival_s)

    def next_use(model: str, now: float) -> float:
        times = arrivals[model]
        i = bisect.bisect_left(times, now)
        return times[i] if i < len(times) else float("inf")

    def belady_plan(
        want: Want, residents: Sequence[Resident], free_bytes: int, total_bytes: int, now: float
    ) -> Decision:
        if (settled := _settled(want, residents, total_bytes)) is not None:
            return settled
        idle = sorted(
            (r for r in residents if r.leases == 0),
            key=lambda r: (-next_use(r.model, now), -r.bytes),
        )
        victims = _prefix(want, idle, len(residents), free_bytes, None)
        if victims is None:
            return _blocked(want, residents, free_bytes, None)
        for r in reversed(list(victims)):  # spare the soonest-needed victims it did not need
            rest = [v for v in victims if v is not r]
            if _fits(want, rest, len(residents), free_bytes, None):
                victims = rest
        return _go(want, victims)

    return belady_plan


def ttl_expired(residents: Sequence[Resident], now: float) -> tuple[str, ...]:
    """The baselines' keep-alive: idle residents whose TTL ran out."""
    return tuple(
        r.model
        for r in residents
        if r.leases == 0 and r.keep_alive_s is not None and now >= r.last_used + r.keep_alive_s
    )


def policies_for(trace: Trace) -> list[Policy]:
    return [
        Policy("modelyard", modelyard_plan, expired, KEEP_ALIVE_S, head_of_line=False),
        Policy("ollama-like", ollama_plan, ttl_expired, KEEP_ALIVE_S, head_of_line=True),
        Policy("llama-swap-like", llama_swap_plan, ttl_expired, None, head_of_line=True),
        Policy("belady", belady_plan_for(trace), ttl_expired, None, head_of_line=False),
    ]


# --------------------------------------------------------------------------------------------
# Simulator


class SimulationError(RuntimeError):
    """A policy broke a rule the engine enforces (evicted a busy model, overfilled the device)."""


@dataclass(frozen=True, slots=True)
class SimParams:
    concurrency: int = 4
    load_fixed_s: float = 1.0
    load_bytes_per_s: float = 2 * GiB

    def load_s(self, nbytes: int) -> float:
        return self.load_fixed_s + nbytes / self.load_bytes_per_s


@dataclass(slots=True)
class _Slot:
    """A model on the device: loading, or ready with requests in service and queued."""

    model: str
    bytes: int
    loading: bool
    last_used: float
    in_flight: int = 0
    queue: deque[Request] = field(default_factory=deque)

    @property
    def leases(self) -> int:
        return self.in_flight + len(self.queue)


@dataclass(slots=True)
class Result:
    trace: str
    policy: str
    requests: int
    completed: int = 0
    failed: int = 0
    loads: int = 0
    bytes_loaded: int = 0
    evictions: int = 0
    ttl_unloads: int = 0
    max_resident: int = 0
    peak_bytes: int = 0
    models_loaded: set[str] = field(default_factory=set)
    delays: list[float] = field(default_factory=list)

    @property
    def swaps(self) -> int:
        return self.loads - len(self.models_loaded)

    def delay_pct(self, q: float) -> float:
        return _percentile(sorted(self.delays), q)

    def summary(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "requests": self.requests, "completed": self.completed,
            "failed": self.failed, "loads": self.loads, "swaps": self.swaps,
            "gib_loaded": self.bytes_loaded / GiB, "evictions": self.evictions,
            "ttl_unloads": self.ttl_unloads, "max_resident": self.max_resident,
            "peak_gib": self.peak_bytes / GiB, "delay_p50_s": self.delay_pct(50),
            "delay_p95_s": self.delay_pct(95),
        }


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks; 0 for no data."""
    if not ordered:
        return 0.0
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# Same-instant order: release leases and finish loads before anything re-plans on arrivals.
_FINISH, _LOADED, _EXPIRE, _ARRIVE = range(4)


class Simulation:
    """One trace under one policy on a simulated clock; ``run()`` once."""

    def __init__(self, trace: Trace, policy: Policy, params: SimParams = SimParams()) -> None:
        self.trace = trace
        self.policy = policy
        self.params = params
        self.now = 0.0
        self.slots: dict[str, _Slot] = {}
        self.result = Result(trace.name, policy.name, len(trace.requests))
        self._events: list[tuple[float, int, int, Request | str]] = []
        self._seq = itertools.count()
        self._in_order: deque[Request] = deque()  # head-of-line policies
        self._by_model: dict[str, deque[Request]] = {}  # the others; oldest waiter's model first

    def run(self) -> Result:
        for req in self.trace.requests:
            self._push(req.arrival_s, _ARRIVE, req)
        while self._events:
            self.now, kind, _, payload = heapq.heappop(self._events)
            self._handle(kind, payload)
            self._place()
        self._check_drained()
        return self.result

    def _push(self, at: float, kind: int, payload: Request | str) -> None:
        heapq.heappush(self._events, (at, kind, next(self._seq), payload))

    def _handle(self, kind: int, payload: Request | str) -> None:
        if isinstance(payload, Request):
            self._arrive(payload)
        elif kind == _FINISH:
            self._finish(payload)
        elif kind == _LOADED:
            slot = self.slots[payload]
            slot.loading = False
            self._serve(slot)
        else:
            self._expire()

    def _arrive(self, req: Request) -> None:
        if self.policy.head_of_line:
            self._in_order.append(req)
        else:
            self._by_model.setdefault(req.model, deque()).append(req)

    # -- placement: ask the policy, apply its decision ------------------------------------

    def _place(self) -> None:
        # Every event re-plans every waiter: plan() is pure, so asking again when nothing
        # changed only repeats a Wait; it re-plans at least on every released lease (§3.4).
        if self.policy.head_of_line:
            while self._in_order:
                if not self._apply(self._decide(self._in_order[0].model), [self._in_order[0]]):
                    return
                self._in_order.popleft()
        else:
            for model in list(self._by_model):
                if self._apply(self._decide(model), self._by_model[model]):
                    del self._by_model[model]

    def _view(self) -> list[Resident]:
        return [
            Resident(
                s.model, s.bytes, leases=s.leases, last_used=s.last_used,
                reload_cost_s=self.params.load_s(s.bytes), keep_alive_s=self.policy.keep_alive_s,
            )
            for s in self.slots.values()
        ]

    def _used(self) -> int:
        return sum(s.bytes for s in self.slots.values())

    def _decide(self, model: str) -> Decision:
        want = Want(model, self.trace.model_bytes[model])
        total = self.trace.total_bytes
        return self.policy.plan(want, self._view(), total - self._used(), total, self.now)

    def _apply(self, decision: Decision, reqs: Sequence[Request]) -> bool:
        """Carry out ``decision`` for ``reqs`` (all for one model); False if they must wait."""
        model = reqs[0].model
        if isinstance(decision, Wait):
            return False
        if isinstance(decision, NoFit):
            self.result.failed += len(reqs)
            return True
        if isinstance(decision, Evict):
            for victim in decision.victims:
                self._unload(victim)
                self.result.evictions += 1
        if isinstance(decision, Load | Evict):
            target = decision.model if isinstance(decision, Load) else decision.then_load
            if target != model or model in self.slots:
                raise SimulationError(f"{self.policy.name}: {decision} for a request for {model}")
            self._start_load(model)
        slot = self.slots.get(model)
        if slot is None:
            raise SimulationError(f"{self.policy.name}: {decision} but {model} is not resident")
        slot.queue.extend(reqs)  # attached: each request now holds a lease
        self._serve(slot)
        return True

    # -- device: loads, unloads, service ---------------------------------------------------

    def _start_load(self, model: str) -> None:
        size = self.trace.model_bytes[model]
        if self._used() + size > self.trace.total_bytes:
            raise SimulationError(
                f"{self.policy.name}: loading {model} needs {size / GiB:.1f} GiB, "
                f"{(self.trace.total_bytes - self._used()) / GiB:.1f} GiB free"
            )
        self.slots[model] = _Slot(model, size, loading=True, last_used=self.now)
        res = self.result
        res.loads += 1
        res.bytes_loaded += size
        res.models_loaded.add(model)
        res.max_resident = max(res.max_resident, len(self.slots))
        res.peak_bytes = max(res.peak_bytes, self._used())
        self._push(self.now + self.params.load_s(size), _LOADED, model)

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
            self.result.delays.append(self.now - req.arrival_s)
            self._push(self.now + req.service_s, _FINISH, slot.model)

    def _finish(self, model: str) -> None:
        slot = self.slots[model]
        slot.in_flight -= 1
        slot.last_used = self.now
        self.result.completed += 1
        self._serve(slot)
        if not slot.leases and self.policy.keep_alive_s is not None:
            self._push(self.now + self.policy.keep_alive_s, _EXPIRE, model)

    def _expire(self) -> None:
        for model in self.policy.expired(self._view(), self.now):
            self._unload(model)
            self.result.ttl_unloads += 1

    def _check_drained(self) -> None:
        res = self.result
        waiting = len(self._in_order) + sum(len(q) for q in self._by_model.values())
        leased = sum(s.leases for s in self.slots.values())
        if waiting or leased or res.completed + res.failed != res.requests:
            raise SimulationError(
                f"{self.policy.name}: {res.completed} done + {res.failed} failed of "
                f"{res.requests}; {waiting} still waiting, {leased} leased"
            )


def simulate(trace: Trace, policy: Policy, params: SimParams = SimParams()) -> Result:
    return Simulation(trace, policy, params).run()


def run_trace(trace: Trace, params: SimParams = SimParams()) -> dict[str, Result]:
    return {p.name: simulate(trace, p, params) for p in policies_for(trace)}


# --------------------------------------------------------------------------------------------
# Report


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


def _fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}"


def render_table(trace: Trace, results: Mapping[str, Result]) -> Table:
    sizes = ", ".join(f"{m} {b / GiB:g}" for m, b in trace.model_bytes.items())
    table = Table(
        title=f"{trace.name}: {len(trace.requests)} requests over "
        f"{trace.requests[-1].arrival_s / 3600:.1f} h on a {trace.total_bytes / GiB:g} GiB device",
        caption=f"models (GiB): {sizes}",
        title_justify="left",
        caption_justify="left",
    )
    for col in ("policy", "requests", "failed", "loads", "swaps", "ttl unloads", "GiB loaded",
                "p50 delay s", "p95 delay s", "swaps/belady", "swaps/llama-swap"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    belady, swap = results["belady"].swaps, results["llama-swap-like"].swaps
    for r in results.values():
        table.add_row(
            r.policy, str(r.requests), str(r.failed), str(r.loads), str(r.swaps),
            str(r.ttl_unloads), f"{r.bytes_loaded / GiB:.0f}", f"{r.delay_pct(50):.2f}",
            f"{r.delay_pct(95):.2f}", _fmt_ratio(_ratio(r.swaps, belady)),
            _fmt_ratio(_ratio(r.swaps, swap)),
        )
    return table


def targets(results: Mapping[str, Result]) -> list[dict[str, Any]]:
    """The agent-trace targets: modelyard's swaps against Belady's and llama-swap-like's."""
    mine = results["modelyard"].swaps
    out = []
    for base, factor in (("belady", TARGET_VS_BELADY), ("llama-swap-like", TARGET_VS_LLAMA_SWAP)):
        bound = factor * results[base].swaps
        out.append({"target": f"modelyard swaps <= {factor}x {base}", "modelyard": mine,
                    "baseline": results[base].swaps, "bound": bound, "pass": mine <= bound})
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--seed", type=int, default=1, help="trace seed (default 1)")
    p.add_argument("--requests", type=int, help="requests per trace (default 2000; --quick: 300)")
    p.add_argument("--quick", action="store_true", help="300 requests per trace")
    p.add_argument("--agents", type=int, default=2, help="agents at once in the agent trace")
    p.add_argument("--out", type=Path, help="JSON results (default bench/results/sched-<ts>.json)")
    p.add_argument("--gpus", default="2x24GiB",
                   help="the node of the multi-GPU traces (bench/sched_multi.py): COUNTxSIZEGiB, "
                   "groups joined by commas (default 2x24GiB)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    n = args.requests or (300 if args.quick else 2000)
    console = Console(width=150)
    t0 = time.perf_counter()
    report: dict[str, Any] = {"seed": args.seed, "requests_per_trace": n, "traces": {},
                              "sim": {"concurrency": SimParams().concurrency, "load_s":
                                      "1 + GiB/2", "keep_alive_s": KEEP_ALIVE_S}}
    agent: dict[str, Result] = {}
    for trace in build_traces(args.seed, n, args.agents):
        results = run_trace(trace)
        agent = results if trace.name == "agent" else agent
        console.print(render_table(trace, results))
        console.print()
        report["traces"][trace.name] = {
            "device_gib": trace.total_bytes / GiB,
            "model_gib": {m: b / GiB for m, b in trace.model_bytes.items()},
            "params": dict(trace.params),
            "results": [r.summary() for r in results.values()],
        }
    report["targets"] = targets(agent)
    for t in report["targets"]:
        verdict = "PASS" if t["pass"] else "MISS"
        console.print(f"agent: {t['target']}: {t['modelyard']} <= {t['bound']:.1f}  {verdict}",
                      highlight=False)
    console.print()
    _run_gpu_traces(args, n, console, report)
    report["elapsed_s"] = time.perf_counter() - t0
    out = args.out or RESULTS_DIR / f"sched-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"{report['elapsed_s']:.1f} s; results in {out}", highlight=False)
    return 0  # a benchmark: misses are reported, not failures


def _run_gpu_traces(
    args: argparse.Namespace, n: int, console: Console, report: dict[str, Any]
) -> None:
    """The multi-GPU traces (bench/sched_multi.py), after the single-device ones."""
    from bench import sched_multi as multi  # it imports this module: import it late

    devices = multi.parse_gpus(args.gpus)
    report["gpu_traces"], report["gpu_goals"] = {}, []
    for trace in multi.build_gpu_traces(args.seed, n, devices):
        results = multi.run_gpu_trace(trace)
        console.print(multi.render_gpu_table(trace, results))
        console.print()
        report["gpu_traces"][trace.name] = {
            "device_gib": [b / GiB for b in trace.device_bytes],
            "model_gib": {m: b / GiB for m, b in trace.model_bytes.items()},
            "params": dict(trace.params),
            "results": [r.summary() for r in results.values()],
        }
        report["gpu_goals"] += multi.gpu_goals(trace, results)
    for g in report["gpu_goals"]:
        verdict = "PASS" if g["pass"] else "MISS"
        console.print(f"{g['trace']}: {g['target']}: {g['modelyard']:g} vs {g['bound']:g}  "
                      f"{verdict}", highlight=False)


if __name__ == "__main__":
    # Run as bench.sched, the module bench/sched_multi.py imports, not as a second __main__ copy.
    sys.path.insert(0, str(ROOT))
    from bench.sched import main as _main

    sys.exit(_main())
