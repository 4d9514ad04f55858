"""The engine's placement and eviction policy: pure, so it is tested as a table (DESIGN.md §3.1).

``plan(want, residents, free_bytes, total_bytes, devices=…, host=…)`` says what the engine must
do to load ``want`` on its device group, and where (the :class:`~.devices.Placement` every
decision that loads carries). It never awaits, does no I/O and reads no clock: time
(``last_used``, ``now``) and memory (each device's free bytes as it reports them, less what the
ledger has reserved) are inputs. The engine loop applies the decision and re-plans on the next
event. Without ``devices`` the group is one device, index 0, with ``free_bytes``/``total_bytes``.

Rules, and why:

* Already resident → :class:`Ready` (nothing to do; the caller takes a lease).
* Bigger than every device set it may take, even empty → :class:`NoFit`: no eviction can ever
  help (unless it may be offloaded, below).
* Never evicted for this want (``protected``): pinned models; models allowed to coexist
  (``coexist_with``, mGPUmanager style, either side naming the other); models of the same
  non-``None`` ``group`` (they cohabit, llama-router style).
* Groups swap exclusively: when either side has a group and the groups differ, the resident
  *must* go even if memory suffices (unless it is allowed to coexist or is pinned → NoFit).
  This holds per engine, whatever devices the two sit on: a group is a set of models that
  take turns on the engine.
* Never evict a model with leases in flight (§3.4), nor one that requests are waiting to lease
  (``waiters``: a load just finished, its requests have not taken their leases yet). If only
  busy models could make room, the request :class:`Wait` s, naming them; the engine re-plans
  when a lease is released.
* Loads that wait for memory are served in arrival order: while an earlier load (``ahead``)
  still waits, a later one waits behind it even if it could be placed now, so a stream of
  small loads cannot starve a big one and a later request cannot take the room an earlier one
  waited for. (Requests for models already resident are not loads: they are served at once.)
* Victims are taken in order of priority (lower first), then least recently used, then the
  cheapest to reload: a prefix of that order until the want fits (memory and
  ``max_loaded_models``, which counts the models of the whole engine), then any victim whose
  room turned out unnecessary is spared, so two are not evicted when one suffices.

Several devices:

* Candidate device sets: every single device, then sets of 2..n devices (only the sizes in
  ``want.split_sizes`` when given: vLLM's tensor parallel size must divide the attention
  heads; only single devices when ``want.splittable`` is False).
* The sets are ranked: one device without eviction > a split without eviction (fewest devices
  first) > one device with evictions > a split with evictions. A model that fits one device is
  never split when that device has room; it is split rather than evicting another model,
  because an eviction costs a certain reload (seconds to minutes, someone's request waits for
  it) while a layer split costs a little per token (llama.cpp passes one activation per token
  across the boundary); evictions are the last resort, as on one device, and for the same
  reason a split that evicts fewer models beats one over fewer devices.
* Then, among sets of the same rank: those touching fewer of ``want.avoid_devices`` (a replica
  goes where its siblings are not), then the fewest and least valuable victims (their positions
  in the victim order, the most valuable first), then the fewest devices, then the best fit
  (the least room left on the set: big holes stay for big models), then the lower device
  indexes (a stable answer). When only busy victims can make room, the set that waits for the
  fewest busy models wins. Count ranks before the GiB the victims hold: by GiB (then least
  recently used) bench/sched.py loads fewer GiB on hot-burst but evicts the small, popular
  models on big-mix (9 % more GiB on 4x24 GiB; docs/multi-gpu.md "Which victims"): no clear
  win, so one recent large victim still beats two old small ones.
* Bytes per device: one device holds ``want.bytes``; a split with ``want.profile`` gets whole
  layers in proportion to each device's room (placement/split.py: the main device also holds
  the weights outside the blocks, each device its compute buffer); without a profile the bytes
  are spread evenly (``split_evenly``). A set fits when every device's share fits its room.
* A victim frees what it holds on EVERY device it spans (its ``placement``; ``None``: all its
  bytes on the group's first device), so evicting one spanning model can make room on two.
  Only victims that hold bytes on the set help its memory; any resident counts for
  ``max_loaded_models``.
* Partial offload (``want.offload`` and a ``host`` room): when the plan would be NoFit, the
  model takes the set (of an allowed size) where the most of its layers fit after evicting
  every idle evictable model on it (the layers left in host RAM run at CPU speed: the more on
  the devices the better; victims whose room adds no layer are spared), the rest in host RAM
  counted against ``host.free_bytes`` → Load/Evict with ``placement.host_bytes > 0``. It does
  not wait for busy models (waiting could only move a few more layers to the devices) nor
  replace a Wait: a model that fits whole once a request finishes waits for it, at full speed.

On the CPU (``want.cpu_reason``: its backend cannot use the group's GPUs, DESIGN.md §3.15):

* The model is placed whole in host RAM (``host``), as a CPU engine would place it: the same
  rules (exclusive groups, ``max_loaded_models``, busy models, the victim order) over one room,
  the host, where each resident holds its placement's ``host_bytes`` (the host part of an
  offload, another model on the CPU) → a placement with no device and ``host_bytes`` its
  bytes. It never takes a device's room, so it never evicts for it. Without a ``host`` room
  (a CPU engine, whose device is host RAM already) it is planned as any model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from modelyard.placement.devices import DeviceRoom, LayerProfile, Placement
from modelyard.placement.split import device_sets, fit, fit_offloaded

__all__ = [
    "Decision",
    "Evict",
    "Load",
    "NoFit",
    "Ready",
    "Resident",
    "Wait",
    "Want",
    "expired",
    "plan",
]


@dataclass(frozen=True, slots=True)
class Resident:
    """A model loaded on the engine's devices, as the engine loop knows it."""

    model: str
    bytes: int
    leases: int = 0
    pinned: bool = False
    priority: int = 0
    last_used: float = 0.0
    group: str | None = None
    coexist_with: frozenset[str] = field(default_factory=frozenset)
    reload_cost_s: float = 0.0
    keep_alive_s: float | None = None  # None: keep forever; 0: unload once idle
    waiters: int = 0  # requests waiting to lease it (not leased yet): it is not idle
    placement: Placement | None = None  # None: all its bytes on the group's first device

    @property
    def busy(self) -> bool:
        return self.leases > 0 or self.waiters > 0


@dataclass(frozen=True, slots=True)
class Want:
    """A model a request needs loaded, with its estimated footprint and how it may be placed."""

    model: str
    bytes: int
    group: str | None = None
    coexist_with: frozenset[str] = field(default_factory=frozenset)
    priority: int = 0
    profile: LayerProfile | None = None  # its bytes by layer: split by layers, offload layers
    offload: bool = False  # may keep layers in host RAM when no device set has room
    avoid_devices: frozenset[int] = frozenset()  # rather not there (a replica's siblings)
    split_sizes: frozenset[int] | None = None  # the set sizes it may take (None: any)
    splittable: bool = True  # False: one device only
    # The backend that serves it, as the engine keys its reach (config `reach_backend`): the
    # view (placement/view.py) sets `cpu_reason` from the engine's status with it.
    backend: str | None = None
    # Why its backend cannot use the group's GPUs: then it is placed whole in host RAM.
    cpu_reason: str | None = None


@dataclass(frozen=True, slots=True)
class Ready:
    """The model is already resident: take a lease and serve."""

    model: str


# A decision that loads carries where the load goes; equality compares the decision itself
# (what loads, what goes), so `Load("a")` still equals a planned `Load("a", placement)`:
# check `.placement` by its own attribute.


@dataclass(frozen=True, slots=True)
class Load:
    """The model fits now: load it on ``placement``."""

    model: str
    placement: Placement | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Evict:
    """Unload ``victims`` (all idle), wait for the memory to come back, then load on
    ``placement``."""

    victims: tuple[str, ...]
    then_load: str
    placement: Placement | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Wait:
    """Only busy models could make room: wait (bounded) and re-plan when a lease is released."""

    reason: str
    blocked_by: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NoFit:
    """Nothing can ever make room: 503 ``insufficient_memory`` with ``reason`` in words."""

    reason: str


Decision = Ready | Load | Evict | Wait | NoFit


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _coexists(want: Want, r: Resident) -> bool:
    return r.model in want.coexist_with or want.model in r.coexist_with


def _same_group(want: Want, r: Resident) -> bool:
    return want.group is not None and want.group == r.group


def _exclusive(want: Want, r: Resident) -> bool:
    return (want.group is not None or r.group is not None) and want.group != r.group


def _order(r: Resident) -> tuple[int, float, float]:
    return (r.priority, r.last_used, r.reload_cost_s)


# What each resident holds on each device, by model: computed once per plan.
Holds = Mapping[str, Mapping[int, int]]

# The host's index among the rooms of a plan on the CPU (the devices' are 0 and up).
HOST = -1


def _holdings(residents: Sequence[Resident], first: int) -> Holds:
    """What each resident holds on each device (one without placement: all of it on `first`,
    the group's first device), and in host RAM (`HOST`: its placement's host part)."""
    holds: dict[str, dict[int, int]] = {}
    for r in residents:
        on = holds.setdefault(r.model, {})
        for d, b in r.placement.device_bytes if r.placement is not None else ((first, r.bytes),):
            on[d] = on.get(d, 0) + b
        if r.placement is not None and r.placement.host_bytes > 0:
            on[HOST] = on.get(HOST, 0) + r.placement.host_bytes
    return holds


def _after(
    rooms: Sequence[DeviceRoom], victims: Sequence[Resident], holds: Holds
) -> tuple[DeviceRoom, ...]:
    """`rooms` once `victims` are gone: each frees what it holds on each of them."""
    return tuple(
        DeviceRoom(r.index, r.free_bytes + sum(holds[v.model].get(r.index, 0) for v in victims),
                   r.total_bytes)
        for r in rooms
    )


Fits = Callable[[list[Resident]], Placement | None]


def _choose(
    fits: Fits, forced: list[Resident], ordered: list[Resident]
) -> tuple[list[Resident], Placement] | None:
    """Forced victims plus the fewest of ``ordered`` (a spared prefix) that make room; or None."""
    chosen = list(forced)
    for r in ordered:
        if fits(chosen) is not None:
            break
        chosen.append(r)
    if fits(chosen) is None:
        return None
    for r in reversed(chosen[len(forced) :]):  # spare what turned out unnecessary
        rest = [v for v in chosen if v is not r]
        if fits(rest) is not None:
            chosen = rest
    placement = fits(chosen)
    assert placement is not None
    return chosen, placement


# (busy victims, evicts at all, is a split, devices when it evicts nothing, avoided devices,
# victims, their positions in the victim order worst first, devices, room left on the set,
# device indexes): compared as a tuple, lower first.
Rank = tuple[int, bool, bool, int, int, int, tuple[int, ...], int, int, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class _Option:
    """One device set that works, with its victims, and its rank (lower is better)."""

    rank: Rank
    victims: tuple[Resident, ...]
    placement: Placement


def _rank(
    want: Want,
    rooms: tuple[DeviceRoom, ...],
    victims: Sequence[Resident],
    placement: Placement,
    position: dict[str, int],
    holds: Holds,
) -> Rank:
    left = sum(r.free_bytes for r in _after(rooms, victims, holds)) - placement.bytes
    k = len(rooms)
    return (
        sum(v.busy for v in victims),
        bool(victims),
        k > 1,
        0 if victims else k,
        sum(r.index in want.avoid_devices for r in rooms),
        len(victims),
        tuple(sorted((position.get(v.model, -1) for v in victims), reverse=True)),
        k,
        left,
        tuple(r.index for r in rooms),
    )


def _options(
    want: Want,
    sets: Sequence[tuple[DeviceRoom, ...]],
    forced: list[Resident],
    ordered: list[Resident],
    n_residents: int,
    cap: int | None,
    holds: Holds,
    *,
    by_size: bool,
) -> list[_Option]:
    """Sets (in size order) that can take `want`, with their victims: forced ones and a spared
    prefix of `ordered`. `by_size` (no busy victims among `ordered`, so the rank starts with
    "evicts at all", "is a split", then the size of a victimless set) skips what cannot rank
    better: the sets larger than the first that takes it without victims, and when some set
    takes it without victims every eviction; when one device with victims does, every split
    with victims (an 8-GPU group has 255 sets, each costs a fit per victim tried)."""
    position = {r.model: i for i, r in enumerate(ordered)}
    candidates = forced + ordered
    options: list[_Option] = []
    if by_size and not forced and (cap is None or n_residents + 1 <= cap):
        for rooms in sets:
            if options and len(rooms) > len(options[0].placement.devices):
                break
            placement = fit(want.bytes, want.profile, rooms)
            if placement is not None:
                options.append(_Option(_rank(want, rooms, [], placement, position, holds), (),
                                       placement))
        if options:
            return options
    for rooms in sets:
        if by_size and options and len(rooms) > 1 and not options[0].rank[2]:
            break  # one device with victims beats every split with victims

        def fits(victims: list[Resident], on: tuple[DeviceRoom, ...] = rooms) -> Placement | None:
            if cap is not None and n_residents - len(victims) + 1 > cap:
                return None
            return fit(want.bytes, want.profile, _after(on, victims, holds))

        if fits(candidates) is None:  # not even with every candidate gone
            continue
        found = _choose(fits, forced, ordered)
        if found is not None:
            victims, placement = found
            options.append(_Option(_rank(want, rooms, victims, placement, position, holds),
                                   tuple(victims), placement))
    return options


def _best(options: list[_Option]) -> _Option | None:
    return min(options, key=lambda o: o.rank) if options else None


def _go(want: Want, option: _Option) -> Load | Evict:
    if not option.victims:
        return Load(want.model, option.placement)
    return Evict(tuple(v.model for v in option.victims), then_load=want.model,
                 placement=option.placement)


def plan(
    want: Want,
    residents: Sequence[Resident],
    free_bytes: int,
    total_bytes: int,
    *,
    max_loaded_models: int | None = None,
    ahead: Sequence[str] = (),
    devices: Sequence[DeviceRoom] | None = None,
    host: DeviceRoom | None = None,
) -> Decision:
    """Decide how to get ``want`` onto the engine's devices (see the module docstring for the
    rules); ``ahead``: loads that arrived before this one and still wait for memory, in order;
    ``devices``: the group's devices (None: one device, index 0, ``free_bytes`` of
    ``total_bytes``); ``host``: host RAM, where an offloadable want may keep layers."""
    if any(r.model == want.model for r in residents):
        return Ready(want.model)
    rooms = tuple(devices) if devices else (DeviceRoom(0, free_bytes, total_bytes),)
    if want.cpu_reason is not None and host is not None:
        decision = _on_cpu(want, residents, rooms[0].index, host, max_loaded_models)
    else:
        sets = device_sets(rooms, splittable=want.splittable, sizes=want.split_sizes)
        never = _never_fits(want, rooms, sets)
        decision = never if never is not None else _plan(want, residents, rooms, sets,
                                                         max_loaded_models)
        if isinstance(decision, NoFit) and want.offload and host is not None:
            decision = _offload(want, residents, rooms, sets, host, max_loaded_models,
                                decision)
    if ahead and not isinstance(decision, NoFit):
        return Wait(
            f"{want.model} waits for earlier loads to be placed first: {', '.join(ahead)}",
            blocked_by=tuple(ahead),
        )
    return decision


def _never_fits(
    want: Want, rooms: Sequence[DeviceRoom], sets: Sequence[tuple[DeviceRoom, ...]]
) -> NoFit | None:
    """NoFit when no set could hold `want` even with nothing else loaded."""
    empty = [tuple(DeviceRoom(r.index, r.total_bytes, r.total_bytes) for r in s) for s in sets]
    if any(fit(want.bytes, want.profile, s) is not None for s in empty):
        return None
    if len(rooms) == 1:
        return NoFit(
            f"{want.model} needs {_gib(want.bytes)}, the device has "
            f"{_gib(rooms[0].total_bytes)} in all"
        )
    largest = max(sum(r.total_bytes for r in s) for s in empty) if empty else 0
    how = "" if want.splittable else " (it may not be split over devices)"
    return NoFit(
        f"{want.model} needs {_gib(want.bytes)}, the devices it may take have {_gib(largest)}"
        f" in all{how}"
    )


def _roles(
    want: Want, residents: Sequence[Resident]
) -> tuple[list[Resident], list[Resident], list[Resident], list[Resident]]:
    """(protected, evictable, forced, pinned and exclusive) residents for `want`."""
    protected = [r for r in residents if r.pinned or _coexists(want, r) or _same_group(want, r)]
    evictable = [r for r in residents if r not in protected]
    forced = [r for r in evictable if _exclusive(want, r)]
    pinned_excl = [
        r for r in residents if r.pinned and _exclusive(want, r) and not _coexists(want, r)
    ]
    return protected, evictable, forced, pinned_excl


def _on_cpu(
    want: Want, residents: Sequence[Resident], first: int, host: DeviceRoom,
    max_loaded_models: int | None,
) -> Decision:
    """`want` whole in host RAM (its backend cannot use the GPUs): planned over the host as
    one room, each resident holding its host part there; a placement with no device."""
    room = DeviceRoom(HOST, host.free_bytes, host.total_bytes)
    if want.bytes > room.total_bytes:
        return NoFit(f"{want.model} runs on the CPU ({want.cpu_reason}) and needs "
                     f"{_gib(want.bytes)}, host RAM has {_gib(room.total_bytes)} in all")
    whole = Want(want.model, want.bytes, group=want.group, coexist_with=want.coexist_with,
                 priority=want.priority, splittable=False)
    decision = _plan(whole, residents, (room,), ((room,),), max_loaded_models, first=first)
    on_host = Placement(device_bytes=(), host_bytes=want.bytes)
    if isinstance(decision, Load):
        return Load(want.model, on_host)
    if isinstance(decision, Evict):
        return Evict(decision.victims, then_load=want.model, placement=on_host)
    return decision


def _plan(
    want: Want,
    residents: Sequence[Resident],
    rooms: Sequence[DeviceRoom],
    sets: Sequence[tuple[DeviceRoom, ...]],
    max_loaded_models: int | None,
    *,
    first: int | None = None,
) -> Decision:
    """`first`: the group's first device, where a resident without a placement holds its
    bytes (default: the first room's)."""
    protected, evictable, forced, pinned_excl = _roles(want, residents)
    if pinned_excl:
        names = ", ".join(f"{r.model} (group {r.group})" for r in pinned_excl)
        return NoFit(
            f"{want.model} (group {want.group}) may not share the device with pinned {names}"
        )
    holds = _holdings(residents, rooms[0].index if first is None else first)
    idle = sorted((r for r in evictable if not r.busy and r not in forced), key=_order)
    busy = sorted((r for r in evictable if r.busy and r not in forced), key=_order)
    n = len(residents)
    if not any(r.busy for r in forced):
        best = _best(_options(want, sets, forced, idle, n, max_loaded_models, holds,
                                    by_size=True))
        if best is not None:
            return _go(want, best)
    best = _best(_options(want, sets, forced, idle + busy, n, max_loaded_models, holds,
                                by_size=False))
    if best is not None:
        blocked = tuple(v.model for v in best.victims if v.busy)
        return Wait(
            f"{want.model} needs {_gib(want.bytes)}; waiting for busy {', '.join(blocked)} "
            "to finish their requests",
            blocked_by=blocked,
        )
    held = sum(r.bytes for r in protected)
    names = ", ".join(r.model for r in protected) or "nothing"
    if max_loaded_models is not None and len(protected) + 1 > max_loaded_models:
        return NoFit(
            f"max_loaded_models is {max_loaded_models} and {len(protected)} models that may "
            f"not be evicted for {want.model} are loaded ({names})"
        )
    free = sum(r.free_bytes for r in rooms)
    return NoFit(
        f"{want.model} needs {_gib(want.bytes)}, but only {_gib(free)} is free and "
        f"{_gib(held)} is held by models that may not be evicted for it ({names})"
    )


def _on_devices(p: Placement) -> tuple[int, int]:
    """How much of a model an offload keeps on the devices: layers first, then bytes."""
    return (sum(p.layers), p.bytes)


def _offload(
    want: Want,
    residents: Sequence[Resident],
    rooms: Sequence[DeviceRoom],
    sets: Sequence[tuple[DeviceRoom, ...]],
    host: DeviceRoom,
    cap: int | None,
    nofit: NoFit,
) -> Decision:
    """The set where the most of `want` fits once its idle evictable models are gone, the
    rest in host RAM; `nofit` (with why the host cannot help) when no set takes any."""
    _protected, evictable, forced, pinned_excl = _roles(want, residents)
    if pinned_excl:
        return nofit
    forced_busy = tuple(r.model for r in forced if r.busy)
    if forced_busy:
        return Wait(f"{want.model} waits for busy {', '.join(forced_busy)} of another group "
                    "to finish their requests", blocked_by=forced_busy)
    holds = _holdings(residents, rooms[0].index)
    idle = sorted((r for r in evictable if not r.busy and r not in forced), key=_order)
    best: tuple[tuple[int, int, int, int, int, tuple[int, ...]], list[Resident], Placement] | None
    best = None
    tried = False  # a set was within max_loaded_models
    for s in sets:

        def offloaded(victims: list[Resident], on: tuple[DeviceRoom, ...] = s) -> Placement | None:
            return fit_offloaded(want.bytes, want.profile, _after(on, victims, holds),
                                 host.free_bytes)

        indexes = {r.index for r in s}
        touching = [r for r in idle if any(holds[r.model].get(d, 0) for d in indexes)]
        others = [r for r in idle if r not in touching]
        victims = forced + touching
        while cap is not None and len(residents) - len(victims) + 1 > cap and others:
            victims.append(others.pop(0))
        if cap is not None and len(residents) - len(victims) + 1 > cap:
            continue
        tried = True
        placement = offloaded(victims)
        if placement is None:
            continue
        for r in reversed(touching):  # spare a victim whose room adds nothing
            rest = [v for v in victims if v is not r]
            smaller = offloaded(rest)
            if smaller is not None and _on_devices(smaller) >= _on_devices(placement):
                victims, placement = rest, smaller
        on = _on_devices(placement)
        rank = (-on[0], -on[1], len(s), sum(r.index in want.avoid_devices for r in s),
                len(victims), tuple(r.index for r in s))
        if best is None or rank < best[0]:
            best = (rank, victims, placement)
    if best is None and not tried:
        return nofit
    if best is None:
        return NoFit(f"{nofit.reason}; offloading does not help: the devices cannot hold its "
                     f"fixed part or host RAM ({_gib(host.free_bytes)} free) the rest")
    _, victims, placement = best
    if not victims:
        return Load(want.model, placement)
    return Evict(tuple(v.model for v in victims), then_load=want.model, placement=placement)


def expired(residents: Sequence[Resident], now: float) -> tuple[str, ...]:
    """Idle, unpinned residents whose ``keep_alive_s`` ran out at ``now`` (lifecycle TTL).

    A model that requests wait to lease is not idle: keep-alive counts from the last lease's
    release, so ``keep_alive_s`` 0 unloads after the request, never before it is served."""
    return tuple(
        r.model
        for r in residents
        if not r.pinned
        and not r.busy
        and r.keep_alive_s is not None
        and now >= r.last_used + r.keep_alive_s
    )
