"""The engine's placement and eviction policy: pure, so it is tested as a table (DESIGN.md §3.1).

``plan(want, residents, free_bytes, total_bytes)`` says what the engine must do to load ``want``
on its device. It never awaits, does no I/O and reads no clock: time (``last_used``, ``now``) and
memory (``free_bytes`` as the device reports it, less what the ledger has reserved) are inputs.
The engine loop applies the decision and re-plans on the next event.

Rules, and why:

* Already resident → :class:`Ready` (nothing to do; the caller takes a lease).
* Bigger than the whole device → :class:`NoFit`: no eviction can ever help.
* Never evicted for this want (``protected``): pinned models; models allowed to coexist
  (``coexist_with``, mGPUmanager style, either side naming the other); models of the same
  non-``None`` ``group`` (they cohabit, llama-router style).
* Groups swap exclusively: when either side has a group and the groups differ, the resident
  *must* go even if memory suffices (unless it is allowed to coexist or is pinned → NoFit).
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
  ``max_loaded_models``), then any victim whose room turned out unnecessary is spared, so two
  are not evicted when one suffices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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
    """A model loaded on the device, as the engine loop knows it."""

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

    @property
    def busy(self) -> bool:
        return self.leases > 0 or self.waiters > 0


@dataclass(frozen=True, slots=True)
class Want:
    """A model a request needs loaded, with its estimated footprint."""

    model: str
    bytes: int
    group: str | None = None
    coexist_with: frozenset[str] = field(default_factory=frozenset)
    priority: int = 0


@dataclass(frozen=True, slots=True)
class Ready:
    """The model is already resident: take a lease and serve."""

    model: str


@dataclass(frozen=True, slots=True)
class Load:
    """The model fits now: load it."""

    model: str


@dataclass(frozen=True, slots=True)
class Evict:
    """Unload ``victims`` (all idle), wait for the memory to come back, then load."""

    victims: tuple[str, ...]
    then_load: str


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


def _choose(
    want: Want,
    forced: list[Resident],
    ordered: list[Resident],
    n_residents: int,
    free_bytes: int,
    cap: int | None,
) -> list[Resident] | None:
    """Forced victims plus the fewest of ``ordered`` (a spared prefix) that make room; or None."""

    def fits(victims: list[Resident]) -> bool:
        room = free_bytes + sum(v.bytes for v in victims) >= want.bytes
        return room and (cap is None or n_residents - len(victims) + 1 <= cap)

    chosen = list(forced)
    for r in ordered:
        if fits(chosen):
            break
        chosen.append(r)
    if not fits(chosen):
        return None
    for r in reversed(chosen[len(forced) :]):  # spare what turned out unnecessary
        rest = [v for v in chosen if v is not r]
        if fits(rest):
            chosen = rest
    return chosen


def plan(
    want: Want,
    residents: Sequence[Resident],
    free_bytes: int,
    total_bytes: int,
    *,
    max_loaded_models: int | None = None,
    ahead: Sequence[str] = (),
) -> Decision:
    """Decide how to get ``want`` onto the device (see the module docstring for the rules);
    ``ahead``: loads that arrived before this one and still wait for memory, in order."""
    if any(r.model == want.model for r in residents):
        return Ready(want.model)
    if want.bytes > total_bytes:
        return NoFit(
            f"{want.model} needs {_gib(want.bytes)}, the device has {_gib(total_bytes)} in all"
        )
    decision = _plan(want, residents, free_bytes, max_loaded_models)
    if ahead and not isinstance(decision, NoFit):
        return Wait(
            f"{want.model} waits for earlier loads to be placed first: {', '.join(ahead)}",
            blocked_by=tuple(ahead),
        )
    return decision


def _plan(
    want: Want, residents: Sequence[Resident], free_bytes: int, max_loaded_models: int | None
) -> Decision:
    protected = [r for r in residents if r.pinned or _coexists(want, r) or _same_group(want, r)]
    evictable = [r for r in residents if r not in protected]
    forced = [r for r in evictable if _exclusive(want, r)]
    pinned_excl = [
        r for r in residents if r.pinned and _exclusive(want, r) and not _coexists(want, r)
    ]
    if pinned_excl:
        names = ", ".join(f"{r.model} (group {r.group})" for r in pinned_excl)
        return NoFit(
            f"{want.model} (group {want.group}) may not share the device with pinned {names}"
        )
    idle = sorted((r for r in evictable if not r.busy and r not in forced), key=_order)
    busy = sorted((r for r in evictable if r.busy and r not in forced), key=_order)
    n = len(residents)
    forced_busy = [r for r in forced if r.busy]
    if not forced_busy:
        victims = _choose(want, forced, idle, n, free_bytes, max_loaded_models)
        if victims is not None:
            if not victims:
                return Load(want.model)
            return Evict(tuple(v.model for v in victims), then_load=want.model)
    victims = _choose(want, forced, idle + busy, n, free_bytes, max_loaded_models)
    if victims is not None:
        blocked = tuple(v.model for v in victims if v.busy)
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
    return NoFit(
        f"{want.model} needs {_gib(want.bytes)}, but only {_gib(free_bytes)} is free and "
        f"{_gib(held)} is held by models that may not be evicted for it ({names})"
    )


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
