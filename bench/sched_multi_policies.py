"""The policies the multi-GPU simulator (bench/sched_multi.py) compares: plan-shaped functions
``(want, loaded, devices, now) -> decision``, where a decision that loads carries the
:class:`~modelyard.placement.devices.Placement` (bytes per device).

Policies:

* **modelyard**: the real ``plan()``/``expired()`` given the devices (``DeviceRoom`` per
  device), each resident's ``Placement`` and the want's ``LayerProfile`` (whole 0.5 GiB
  layers, as a GGUF's tensors give it, so a split follows each device's room); keep-alive
  300 s; per-model queues (a request for a loaded model never waits behind another's load).
* **ollama-like**, after ollama/ollama ``server/sched.go`` (``pickBestFitGPUs`` /
  ``pickBestFullFitByLibrary``, ``findRunnerToUnload``): the GPUs sorted by free memory,
  most first; the model goes whole on the first single GPU that fits (so the *emptiest* GPU,
  not the tightest), else spread over all GPUs, split in proportion to their free memory
  (llama.cpp's layer split, here by the byte, which can only flatter it); GPUs with a model
  still loading are left out, and if only they could take it the request waits (Ollama
  re-queues it). If nothing fits it unloads one idle runner at a time and retries, waits for
  busy runners if only they hold the room, and loads at most 3 models per GPU
  (``OLLAMA_MAX_LOADED_MODELS``' default). Victim order is the soonest keep-alive expiry (LRU
  at equal keep-alives); Ollama itself sorts by session duration then model name, which at
  equal keep-alives is alphabetical, so this is a kinder baseline. Head-of-line: requests are
  placed in arrival order (``processPending``). Newer Ollama packs into the fewest of the
  emptiest GPUs rather than one-or-all: the same on two.
* **llama-swap-like**: one model at a time (exclusive swap, no TTL), always spread over all
  GPUs as llama-server does by default; head-of-line like its swap lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.sched import KEEP_ALIVE_S, OLLAMA_MAX_LOADED_MODELS, SimulationError
from modelyard.placement.devices import DeviceRoom, Placement
from modelyard.placement.policy import (
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


@dataclass(frozen=True, slots=True)
class Loaded:
    """A model on the node as the simulator shows it to a policy."""

    model: str
    placement: Placement
    leases: int  # requests in flight or queued on it
    loading: bool
    last_used: float
    keep_alive_s: float | None
    reload_cost_s: float

    @property
    def busy(self) -> bool:
        return self.leases > 0 or self.loading


@dataclass(frozen=True, slots=True)
class Place:
    """Unload ``victims`` (idle), then load ``model`` at ``placement``."""

    model: str
    victims: tuple[str, ...]
    placement: Placement


GpuDecision = Ready | Place | Wait | NoFit
GpuPlanFn = Callable[[Want, Sequence[Loaded], Sequence[DeviceRoom], float], GpuDecision]
GpuExpireFn = Callable[[Sequence[Loaded], float], tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class GpuPolicy:
    name: str
    plan: GpuPlanFn
    expired: GpuExpireFn
    keep_alive_s: float | None
    head_of_line: bool


def _residents(loaded: Sequence[Loaded]) -> list[Resident]:
    return [
        Resident(
            r.model, r.placement.bytes, leases=r.leases + (1 if r.loading else 0),
            last_used=r.last_used, reload_cost_s=r.reload_cost_s, keep_alive_s=r.keep_alive_s,
            placement=r.placement,
        )
        for r in loaded
    ]


def modelyard_plan(
    want: Want, loaded: Sequence[Loaded], devices: Sequence[DeviceRoom], now: float
) -> GpuDecision:
    free = sum(d.free_bytes for d in devices)
    total = sum(d.total_bytes for d in devices)
    decision = plan(want, _residents(loaded), free, total, devices=devices)
    if isinstance(decision, Load | Evict):
        if decision.placement is None:  # plan() over devices always says where
            raise SimulationError(f"modelyard: {decision} carries no placement")
        victims = decision.victims if isinstance(decision, Evict) else ()
        model = decision.then_load if isinstance(decision, Evict) else decision.model
        return Place(model, victims, decision.placement)
    return decision


def modelyard_expired(loaded: Sequence[Loaded], now: float) -> tuple[str, ...]:
    return expired(_residents(loaded), now)


def ttl_expired(loaded: Sequence[Loaded], now: float) -> tuple[str, ...]:
    return tuple(
        r.model for r in loaded
        if not r.busy and r.keep_alive_s is not None and now >= r.last_used + r.keep_alive_s
    )


def split_by_free(nbytes: int, free: Sequence[tuple[int, int]]) -> Placement | None:
    """``nbytes`` over ``free`` ((device, free bytes), in order), in proportion to each one's
    free memory (llama.cpp's default split); None if they do not hold it together."""
    room = sum(f for _, f in free)
    if nbytes > room or room <= 0:
        return None
    parts = [(d, nbytes * f // room) for d, f in free]
    rest = nbytes - sum(b for _, b in parts)
    out = []
    for d, b in parts:  # the rounding goes where there is slack (there always is: rest < n)
        add = min(rest, dict(free)[d] - b)
        out.append((d, b + add))
        rest -= add
    return Placement(device_bytes=tuple((d, b) for d, b in out if b > 0))


def _free_after(
    devices: Sequence[DeviceRoom], victims: Sequence[Loaded]
) -> list[tuple[int, int]]:
    return [(d.index, d.free_bytes + sum(v.placement.on(d.index) for v in victims))
            for d in devices]


def ollama_fit(nbytes: int, free: Sequence[tuple[int, int]]) -> Placement | None:
    """Ollama's pick: the emptiest single GPU that holds it whole, else all GPUs together."""
    ordered = sorted(free, key=lambda df: (-df[1], df[0]))
    for d, f in ordered:
        if f >= nbytes:
            return Placement.whole(d, nbytes)
    return split_by_free(nbytes, ordered)


def _node_settled(want: Want, loaded: Sequence[Loaded],
                  devices: Sequence[DeviceRoom]) -> GpuDecision | None:
    if any(r.model == want.model for r in loaded):
        return Ready(want.model)
    if want.bytes > sum(d.total_bytes for d in devices):
        return NoFit(f"{want.model} is bigger than the node")
    return None


def ollama_plan(
    want: Want, loaded: Sequence[Loaded], devices: Sequence[DeviceRoom], now: float
) -> GpuDecision:
    if (settled := _node_settled(want, loaded, devices)) is not None:
        return settled
    cap = OLLAMA_MAX_LOADED_MODELS * len(devices)
    loading_on = {d for r in loaded if r.loading for d in r.placement.devices}
    avail = [d for d in devices if d.index not in loading_on]

    def expires_at(r: Loaded) -> float:
        return r.last_used + (r.keep_alive_s if r.keep_alive_s is not None else float("inf"))

    idle = sorted((r for r in loaded if not r.busy), key=expires_at)
    victims: list[Loaded] = []
    for nxt in [*idle, None]:  # unload one idle runner at a time until it fits
        if len(loaded) - len(victims) + 1 <= cap:
            placement = ollama_fit(want.bytes, _free_after(avail, victims))
            if placement is not None:
                return Place(want.model, tuple(v.model for v in victims), placement)
        if nxt is not None:
            victims.append(nxt)
    busy = tuple(r.model for r in loaded if r.busy)
    return Wait(f"{want.model} waits for {', '.join(busy)}", blocked_by=busy)


def llama_swap_plan(
    want: Want, loaded: Sequence[Loaded], devices: Sequence[DeviceRoom], now: float
) -> GpuDecision:
    if (settled := _node_settled(want, loaded, devices)) is not None:
        return settled
    busy = tuple(r.model for r in loaded if r.busy)
    if busy:
        return Wait(f"{want.model} waits for {busy[0]} to finish", blocked_by=busy)
    placement = split_by_free(want.bytes, [(d.index, d.total_bytes) for d in devices])
    if placement is None:  # unreachable: it is no bigger than the node
        return NoFit(f"{want.model} does not fit the node")
    return Place(want.model, tuple(r.model for r in loaded), placement)


def gpu_policies() -> list[GpuPolicy]:
    return [
        GpuPolicy("modelyard", modelyard_plan, modelyard_expired, KEEP_ALIVE_S, False),
        GpuPolicy("ollama-like", ollama_plan, ttl_expired, KEEP_ALIVE_S, True),
        GpuPolicy("llama-swap-like", llama_swap_plan, ttl_expired, None, True),
    ]
