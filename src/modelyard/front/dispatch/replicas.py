"""Replicas of a hot model (`replicas`, `max_replicas`): which copy serves a request, when a
copy is added, when an extra one goes.

A copy is a model of its own to the engines, `<model>#<k>` (store/registry.py): its own server,
memory, queue and keep-alive, scheduled and never evicted in flight like any model. The front
sends a request for `<model>` to one of its copies before it queues, so each copy's queue is the
ordinary per-model queue and nothing else changes on the way (lease, early send, a down engine).

* Balance: the copy with the least work in flight (running + queued in its queue), the lowest
  k on a tie; a chat session stays on the copy it used while that copy is a member. A session
  this front has not seen yet starts on its home copy, chosen from its id among the pinned
  copies (`home_copy`): every front picks the same one, so a session continued on another
  front (several fronts on one database) finds its KV on the copy that holds it.
* Members: the pinned copies (k ≤ `replicas`, loaded at start) and the extra copies loaded by a
  scale-up; a copy joins once it is loaded, so no request waits for a copy's load.
* Scale up: a request that waits `replica_scale_up_wait_s` in a copy's queue, while fewer than
  `max_replicas` copies exist and none is loading, loads the next copy in the background, on an
  engine that holds no sibling where there is one. Once it is loaded, requests still waiting in
  the other copies' queues move to it (they leave their queue and queue again there) while it
  has less work than the copy they wait on.
* Scale down: an extra copy with nothing in flight for `replica_idle_s` leaves the members, then
  is unloaded. Its leases carry a keep-alive of twice that, so the engine drops it anyway if the
  front cannot (and never before the front stopped routing to it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from modelyard.errors import ModelyardError
from modelyard.front.dispatch.queueing import Slot
from modelyard.store.registry import (
    Entry,
    ModelRegistry,
    max_copies,
    replica_name,
    split_replica_name,
)

log = logging.getLogger(__name__)

MAX_AFFINITIES = 4096  # sessions remembered per server (least recently used forgotten)


def pick_copy(members: Sequence[str], work: Mapping[str, int], prefer: str | None = None) -> str:
    """The copy a request goes to: `prefer` (a session's) while it is a member, else the one
    with the least work in flight, the first in `members` on a tie."""
    if prefer is not None and prefer in members:
        return prefer
    return min(members, key=lambda m: (work.get(m, 0), members.index(m)))


def home_copy(session: str, members: Sequence[str], pinned: int) -> str | None:
    """A session's copy from its id alone (rendezvous hashing over the pinned copies, which
    every front has): the same answer on every front, and few sessions move when the count
    changes. None: no pinned copy is a member."""
    candidates = [m for m in members if _k(m) <= pinned] or list(members)
    if not candidates:
        return None
    return max(candidates, key=lambda m: hashlib.blake2b(
        f"{session}\0{m}".encode(), digest_size=8).digest())


def next_copy(base: str, members: Sequence[str], copies: int, loading: bool) -> str | None:
    """The copy a scale-up loads: the lowest k not a member, while fewer than `copies` exist
    and none is loading; None: no scale-up."""
    if loading or len(members) >= copies:
        return None
    for k in range(1, copies + 1):
        name = replica_name(base, k)
        if name not in members:
            return name
    return None


def _k(copy: str) -> int:
    parsed = split_replica_name(copy)
    return 1 if parsed is None else parsed[1]


@dataclass
class _Copies:
    base: str
    members: list[str]  # in k order; the pinned ones first
    pinned: int  # how many of them are pinned (k ≤ replicas)
    most: int  # max_copies() when the members were set
    loading: str | None = None
    engines: dict[str, str] = field(default_factory=dict)  # copy → engine last seen on
    idle: dict[str, asyncio.TimerHandle] = field(default_factory=dict)
    failed_at: float | None = None  # the last scale-up that failed (loop time)
    waiting: list[_Waiter] = field(default_factory=list)  # requests in the copies' queues


@dataclass(eq=False)
class _Waiter:
    copy: str
    moved: asyncio.Future[str]  # the copy it should move to


class MovedToCopy(Exception):
    """A waiting request leaves its copy's queue for a copy that joined (`Replicas.waiting`)."""

    def __init__(self, copy: str) -> None:
        super().__init__(copy)
        self.copy = copy


async def unless_moved(acquiring: Awaitable[Slot], moved: asyncio.Future[str]) -> Slot:
    """A queue slot, unless the request is moved to another copy first (MovedToCopy): then it
    leaves the queue (the queue passes on a slot it was handed meanwhile)."""
    task = asyncio.ensure_future(acquiring)
    either: set[asyncio.Future[Any]] = {task, moved}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the request was cancelled (its client left)
        task.cancel()
        with contextlib.suppress(BaseException):
            (await task).release()  # granted just before the cancellation took
        raise
    if task.done():
        return task.result()  # a slot (or the queue's refusal): it stays here
    task.cancel()
    try:
        return await task  # granted before the cancellation took: it stays here
    except asyncio.CancelledError:
        raise MovedToCopy(moved.result()) from None


# (copy entry, keep-alive) → the engine that loaded it.
LoadCopy = Callable[[Entry, float | None], Awaitable[str]]
UnloadCopy = Callable[[str, str], Awaitable[Any]]


class Replicas:
    """The front's copies of replicated models."""

    def __init__(
        self,
        settings: Callable[[], Any],
        registry: Callable[[], ModelRegistry],
    ) -> None:
        self._settings = settings  # the settings in force (a reload replaces them)
        self._registry = registry
        # Requests sent to each copy and not closed yet: queued, running, and those between
        # the choice and the queue (a burst chooses before any of it is queued).
        self._inflight: Counter[str] = Counter()
        self._models: dict[str, _Copies] = {}
        self._affinity: OrderedDict[str, str] = OrderedDict()  # session → copy
        self._tasks: set[asyncio.Task[None]] = set()
        self.load: LoadCopy | None = None  # set by the dispatcher
        self.unload: UnloadCopy | None = None

    # -- which copy ----------------------------------------------------------------------------

    def _copies(self, entry: Entry) -> _Copies | None:
        spec = entry.spec
        if max_copies(spec) < 2 or split_replica_name(entry.id) is not None:
            return None
        copies = self._models.get(entry.id)
        most = max_copies(spec)
        if copies is None or (copies.pinned, copies.most) != (spec.replicas, most):
            # New, or a reload changed its counts: copies beyond the new maximum leave (their
            # keep-alive unloads them), pinned ones beyond `replicas` become extra ones.
            members = [replica_name(entry.id, k) for k in range(1, spec.replicas + 1)]
            extra = [] if copies is None else [
                m for m in copies.members if m not in members and _k(m) <= most]
            old = copies
            copies = self._models[entry.id] = _Copies(
                entry.id, members + extra, spec.replicas, most)
            if old is not None:
                copies.engines, copies.idle, copies.loading = old.engines, old.idle, old.loading
                copies.waiting = old.waiting
        return copies

    def _work(self, model: str) -> int:
        return self._inflight[model]

    def choose(
        self, entry: Entry, session: str | None = None
    ) -> tuple[Entry, Callable[[], None] | None]:
        """The entry a request for `entry` is served as: one of its copies (itself when it has
        none), and what to call once the request is over (idempotent; None: no copies)."""
        copies = self._copies(entry)
        if copies is None:
            return entry, None
        prefer = None
        if session is not None:
            prefer = self._affinity.get(session) or home_copy(
                session, copies.members, copies.pinned)
        work = {m: self._work(m) for m in copies.members}
        chosen = pick_copy(copies.members, work, prefer)
        if session is not None:
            self._affinity[session] = chosen
            self._affinity.move_to_end(session)
            while len(self._affinity) > MAX_AFFINITIES:
                self._affinity.popitem(last=False)
        return self._ticket(entry, chosen)

    def _ticket(self, entry: Entry, chosen: str) -> tuple[Entry, Callable[[], None]]:
        copies = self._models[entry.id]
        self._busy(copies, chosen)
        self._inflight[chosen] += 1
        over = False

        def done() -> None:
            nonlocal over
            if not over:
                over = True
                self._inflight[chosen] -= 1
                self._finished(chosen)

        return (entry if chosen == entry.id else self._registry().resolve(chosen)), done

    def keep_alive_s(self, model: str, asked: float | None) -> float | None:
        """An extra copy's leases keep it for twice `replica_idle_s` (the front unloads it
        sooner); anything else keeps what the request asked."""
        copies = self._of_copy(model)
        if copies is None or copies[1] <= copies[0].pinned:
            return asked
        return 2 * float(self._settings().replica_idle_s)

    def avoid(self, model: str) -> frozenset[str]:
        """The engines that hold a sibling of copy `model`: a new copy prefers another one."""
        found = self._of_copy(model)
        if found is None:
            return frozenset()
        copies = found[0]
        return frozenset(e for m, e in copies.engines.items() if m != model)

    def placed(self, model: str, engine: str) -> None:
        """Copy `model` was granted (or loaded) on `engine`."""
        found = self._of_copy(model)
        if found is not None:
            found[0].engines[model] = engine

    def _of_copy(self, model: str) -> tuple[_Copies, int] | None:
        parsed = split_replica_name(model)
        base, k = parsed if parsed is not None else (model, 1)
        copies = self._models.get(base)
        return None if copies is None else (copies, k)

    async def load_pinned(self) -> None:
        """At start: every copy of each model with `replicas` > 1, one after the other so each
        goes where its siblings are not. A copy that cannot load (no room) is logged and takes
        no requests (they would wait for memory its pinned siblings never give back); the
        model itself always does (its errors are the client's answer)."""
        assert self.load is not None
        for entry in self._registry().entries():
            copies = self._copies(entry) if entry.preset is None else None
            if copies is None:
                continue
            for name in list(copies.members[:copies.pinned]):
                try:
                    copies.engines[name] = await self.load(self._registry().resolve(name), None)
                except ModelyardError as exc:
                    log.error("copy %s not loaded: %s", name, exc.full_message())
                    if name != copies.base:
                        copies.members.remove(name)
                else:
                    log.info("copy %s loaded on %s", name, copies.engines[name])

    def pinned_placements(self) -> dict[str, str]:
        """Each pinned copy (k ≤ `replicas`) that was loaded → the engine it was loaded on:
        front/ops/replace.py loads one again when its engine leaves."""
        return {m: e for c in self._models.values() for m, e in c.engines.items()
                if _k(m) <= c.pinned and m in c.members}

    async def replace_copy(self, entry: Entry) -> str:
        """Load copy `entry` again, where its siblings are not (its engine left); the
        engine's name."""
        assert self.load is not None
        found = self._of_copy(entry.id)
        if found is not None:
            found[0].engines.pop(entry.id, None)  # not there any more: no sibling to avoid
        engine = await self.load(entry, None)
        self.placed(entry.id, engine)
        return engine

    # -- scale up ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def waiting(self, model: str) -> Iterator[asyncio.Future[str] | None]:
        """Around a request's wait in copy `model`'s queue: one that waits past
        `replica_scale_up_wait_s` asks for one more copy. The future it gives names the copy
        the request should move to, once a new copy has less work than this one (None: not a
        copy)."""
        found = self._of_copy(model)
        if found is None:
            yield None
            return
        copies = found[0]
        loop = asyncio.get_running_loop()
        waiter = _Waiter(model, loop.create_future())
        copies.waiting.append(waiter)
        timer = None
        if len(copies.members) < self._max(copies):
            wait_s = float(self._settings().replica_scale_up_wait_s)
            timer = loop.call_later(wait_s, self._scale_up, copies)
        try:
            yield waiter.moved
        finally:
            if timer is not None:
                timer.cancel()
            with contextlib.suppress(ValueError):
                copies.waiting.remove(waiter)

    def take(self, entry: Entry, copy: str, session: str | None = None) -> tuple[
            Entry, Callable[[], None]]:
        """A request that moved to `copy` (see `waiting`): that copy's entry and ticket."""
        if session is not None and session in self._affinity:
            self._affinity[session] = copy
        return self._ticket(entry, copy)

    def _rebalance(self, copies: _Copies, joined: str) -> None:
        """A copy joined: requests waiting in the other copies' queues move to it while it has
        less work than the copy they wait on (the first waiters first)."""
        work = {m: self._work(m) for m in copies.members}
        for waiter in copies.waiting:
            if waiter.copy != joined and work[joined] + 1 < work.get(waiter.copy, 0) and (
                    not waiter.moved.done()):
                waiter.moved.set_result(joined)
                work[joined] += 1
                work[waiter.copy] -= 1

    def _max(self, copies: _Copies) -> int:
        entry = self._registry().get(copies.base)
        return 1 if entry is None else max_copies(entry.spec)

    def _scale_up(self, copies: _Copies) -> None:
        loop = asyncio.get_running_loop()
        if copies.failed_at is not None and (
                loop.time() - copies.failed_at < float(self._settings().replica_idle_s)):
            return  # it did not fit a moment ago: not one load attempt per waiting request
        name = next_copy(copies.base, copies.members, self._max(copies),
                         copies.loading is not None)
        if name is None or self.load is None:
            return
        copies.loading = name
        task = asyncio.create_task(self._load(copies, name), name=f"scale-up:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _load(self, copies: _Copies, name: str) -> None:
        assert self.load is not None
        log.info("%s: a request waited %gs: loading copy %s", copies.base,
                 self._settings().replica_scale_up_wait_s, name)
        try:
            entry = self._registry().resolve(name)
            engine = await self.load(entry, self.keep_alive_s(name, None))
        except ModelyardError as exc:
            copies.failed_at = asyncio.get_running_loop().time()
            log.warning("%s: copy %s not loaded: %s", copies.base, name, exc.full_message())
            return
        finally:
            copies.loading = None
        copies.engines[name] = engine
        if name not in copies.members:
            copies.members.append(name)
        self._idle(copies, name)  # unused, it goes again after the idle time
        self._rebalance(copies, name)

    # -- scale down ----------------------------------------------------------------------------

    def _finished(self, model: str) -> None:
        """A request of copy `model` closed: an extra copy with nothing left in flight starts
        its idle time."""
        found = self._of_copy(model)
        if found is not None and found[1] > found[0].pinned and self._work(model) == 0:
            self._idle(found[0], model)

    def _busy(self, copies: _Copies, model: str) -> None:
        timer = copies.idle.pop(model, None)
        if timer is not None:
            timer.cancel()

    def _idle(self, copies: _Copies, model: str) -> None:
        self._busy(copies, model)
        delay = float(self._settings().replica_idle_s)
        copies.idle[model] = asyncio.get_running_loop().call_later(
            delay, self._drop, copies, model)

    def _drop(self, copies: _Copies, model: str) -> None:
        copies.idle.pop(model, None)
        if self._work(model) > 0 or model not in copies.members or _k(model) <= copies.pinned:
            return
        copies.members.remove(model)
        engine = copies.engines.pop(model, None)
        log.info("%s: copy %s idle for %gs: unloaded", copies.base, model,
                 self._settings().replica_idle_s)
        if engine is not None and self.unload is not None:
            task = asyncio.create_task(self._unload(engine, model), name=f"scale-down:{model}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _unload(self, engine: str, model: str) -> None:
        assert self.unload is not None
        try:
            await self.unload(engine, model)
        except ModelyardError as exc:  # its keep-alive unloads it then
            log.info("copy %s not unloaded on %s: %s", model, engine, exc.message)

    # -- reports -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """/status `replicas`: per replicated model, its copies and what each has in flight."""
        return {
            base: {
                "max_copies": self._max(c),
                "loading": c.loading,
                "copies": [{"model": m, "engine": c.engines.get(m), "pinned": _k(m) <= c.pinned,
                            "work": self._work(m)} for m in c.members],
            }
            for base, c in self._models.items()
        }

    async def close(self) -> None:
        for copies in self._models.values():
            for timer in copies.idle.values():
                timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
