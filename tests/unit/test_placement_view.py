"""placement/view.py: the front predicts the engine's placement decision from the engine's typed
status, with the same builder and policy the engine decides with (DESIGN.md §3.11).

Each row sets up a real `Engine` (an honest in-test device, stub servers that only carry a pid)
with models in the states and with the fields the policy reads, then compares three answers:
the engine's own decision (`Engine._decide`, what it does when the load comes), the front's
prediction from the engine's /status JSON after a trip through the wire types, and the expected
decision. Issue 16's misroute is the first row: the front used to plan Evict(a) there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from modelyard.config import OpenAIServerModel, Settings
from modelyard.engine.loop import Engine
from modelyard.engine.runtime import ModelState
from modelyard.front.dispatch import routing
from modelyard.placement import policy as scheduler
from modelyard.placement import view as placement
from modelyard.store.estimate import serving_bytes
from modelyard.store.registry import ModelRegistry
from modelyard.types import DeviceInfo
from modelyard.wire.status import EngineStatus

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

GiB = 2**30
NOW = 1000.0


class TableDevice:
    """A device that reports what the row says: total, free, and what each pid holds."""

    kind = "simulated"

    def __init__(self, total: int, free: int) -> None:
        self.total, self.free = total, free
        self.held: dict[int, int] = {}

    def info(self) -> DeviceInfo:
        return DeviceInfo(0, None, "table", self.total, self.total - self.free, self.free,
                          None, None, kind="simulated")

    def used_by(self, pids: Iterable[int]) -> dict[int, int]:
        return {pid: self.held[pid] for pid in pids if pid in self.held}

    def child_env(self) -> dict[str, str]:
        return {}

    def on_spawn(self, pid: int, reserved_bytes: int) -> None:
        pass


@dataclass
class StubServer:
    """Stands for a loaded model's server: the engine reads its pid and URL here."""

    pid: int
    url: str = "http://127.0.0.1:9"
    alive: bool = True

    def memory_bytes(self) -> int | None:
        return None

    def tail(self, lines: int) -> list[str]:
        return []


@dataclass(frozen=True)
class R:
    """A model in the engine: its config fields and the state it is in (None: not resident)."""

    id: str
    gib: float
    state: str | None = "ready"
    measured_gib: float | None = None  # None: what it was promised (gib)
    leases: int = 0
    waiters: int = 0
    last_used: float = 0.0
    load_duration_s: float | None = None
    keep_alive_s: float | None = None
    spec: dict[str, Any] = field(default_factory=dict)  # pinned, priority, group, coexist…
    vram: bool = True  # False: no vram_bytes in its config (a load then promises what it knows)
    known_gib: float | None = None  # what its last load measured (the engine remembers it)


@dataclass(frozen=True)
class Row:
    name: str
    models: tuple[R, ...]
    want: R
    free_gib: float
    expected: scheduler.Decision
    total_gib: float = 8
    max_loaded_models: int | None = None
    placing: tuple[str, ...] = ()  # loads that began earlier and wait to be placed


def _spec(r: R) -> OpenAIServerModel:
    return OpenAIServerModel.model_validate({
        "id": r.id, "backend": "openai", "argv": ["true"],
        "vram_bytes": int(r.gib * GiB) if r.vram else None, **r.spec,
    })


ROWS = [
    Row("coexist-named-by-the-resident (issue 16)",
        (R("a", 4, spec={"can_coexist_with": ["b"]}),), R("b", 4), 2,
        scheduler.NoFit("")),
    Row("coexist-named-by-the-want",
        (R("a", 4),), R("b", 4, state=None, spec={"can_coexist_with": ["a"]}), 2,
        scheduler.NoFit("")),
    Row("reload-cost-breaks-a-tie",
        (R("a", 3, load_duration_s=9.0), R("b", 3, load_duration_s=1.0)), R("c", 3), 2,
        scheduler.Evict(("b",), "c")),
    Row("waiters-make-it-busy",
        (R("a", 3, waiters=1),), R("c", 5), 2,
        scheduler.Wait("", ("a",))),
    Row("leases-make-it-busy",
        (R("a", 3, leases=2),), R("c", 5), 2,
        scheduler.Wait("", ("a",))),
    Row("pinned-is-never-a-victim",
        (R("a", 6, spec={"pinned": True}),), R("c", 3), 2,
        scheduler.NoFit("")),
    Row("lower-priority-goes-first",
        (R("a", 3, spec={"priority": 5}), R("b", 3)), R("c", 3), 2,
        scheduler.Evict(("b",), "c")),
    Row("least-recently-used-goes-first",
        (R("a", 3, last_used=20.0), R("b", 3, last_used=10.0)), R("c", 3), 2,
        scheduler.Evict(("b",), "c")),
    Row("another-group-swaps-out",
        (R("a", 1, spec={"group": "g1"}),), R("c", 1, spec={"group": "g2"}), 7,
        scheduler.Evict(("a",), "c")),
    Row("same-group-cohabits",
        (R("a", 6, spec={"group": "g1"}),), R("c", 3, spec={"group": "g1"}), 2,
        scheduler.NoFit("")),
    Row("loading-counts-what-it-holds-already",
        # promised 4, the device shows 3 of them: 1 more to come, so 5 - 1 = 4 are plannable
        (R("a", 4, state="loading", measured_gib=3),), R("c", 3), 5,
        scheduler.Load("c")),
    Row("loading-is-busy",
        (R("a", 6, state="loading", measured_gib=1),), R("c", 3), 7,
        scheduler.Wait("", ("a",))),
    Row("loading-past-its-promise-holds-what-it-measures",
        (R("a", 2, state="loading", measured_gib=5), R("b", 2)), R("c", 3), 1,
        scheduler.Evict(("b",), "c")),
    Row("ready-holds-what-was-measured",
        # a was promised 4 but holds 1: evicting it alone would not make room for 4
        (R("a", 4, measured_gib=1, last_used=1.0), R("b", 3, last_used=2.0)), R("c", 4), 2,
        scheduler.Evict(("b",), "c")),
    Row("max-loaded-models",
        (R("a", 1),), R("c", 1), 7, scheduler.Evict(("a",), "c"), max_loaded_models=1),
    Row("an-earlier-load-is-placed-first",
        (R("a", 2),), R("c", 1), 6, scheduler.Wait("", ("x",)), placing=("x",)),
    Row("the-next-load-takes-what-the-last-measured",
        (R("a", 4),), R("c", 0, state=None, vram=False, known_gib=5), 4,
        scheduler.Evict(("a",), "c")),
    Row("bigger-than-the-device",
        (), R("c", 9), 8, scheduler.NoFit("")),
    Row("fits", (R("a", 2),), R("c", 3), 6, scheduler.Load("c")),
]


@pytest.fixture
async def build(tmp_path: Path) -> AsyncIterator[Callable[[Row], tuple[Engine, Any]]]:
    """Makes a row's engine; returns it with the want's runtime."""
    pending: list[asyncio.Future[None]] = []

    def make(row: Row) -> tuple[Engine, Any]:
        models = list(row.models)
        if all(m.id != row.want.id for m in models):
            models.append(replace(row.want, state=None))
        models += [R(x, 1, state=None) for x in row.placing]
        settings = Settings(home=tmp_path, scan_hf_cache=False,
                            models=[_spec(m) for m in models],
                            max_loaded_models=row.max_loaded_models)
        device = TableDevice(int(row.total_gib * GiB), int(row.free_gib * GiB))
        engine = Engine(settings, ModelRegistry.build(settings), device=device, clock=lambda: NOW)
        for pid, m in enumerate(models, start=100):
            rt = engine._runtime(engine.registry.resolve(m.id))
            if m.known_gib is not None:
                rt.known_bytes = int(m.known_gib * GiB)
            if m.state is None:
                continue
            rt.reserved_bytes = int(m.gib * GiB)
            rt.pid = pid
            device.held[pid] = int((m.gib if m.measured_gib is None else m.measured_gib) * GiB)
            rt.leases = {f"lease-{i}" for i in range(m.leases)}
            rt.waiters = m.waiters
            rt.last_used = m.last_used
            rt.load_duration_s = m.load_duration_s
            rt.keep_alive_s = m.keep_alive_s
            if m.state == "loading":
                rt.state = ModelState.LOADING
                load = asyncio.get_running_loop().create_future()
                pending.append(load)
                rt.load = load  # type: ignore[assignment]
            else:
                rt.state = ModelState.READY
                rt.server = StubServer(pid)  # type: ignore[assignment]
        for x in row.placing:
            engine._arrivals[x] = None
        return engine, engine._runtime(engine.registry.resolve(row.want.id))

    yield make
    for load in pending:
        load.cancel()


def _front_want(row: Row) -> scheduler.Want:
    """The want as the front builds it (front/state.py `_snapshot_views`)."""
    spec = _spec(row.want)
    return scheduler.Want(model=spec.id, bytes=serving_bytes(spec, None), group=spec.group,
                          coexist_with=frozenset(spec.can_coexist_with), priority=spec.priority)


def _wire(engine: Engine) -> EngineStatus:
    """The engine's status as the front gets it: encoded, sent as JSON, decoded."""
    return EngineStatus.from_json(orjson.loads(orjson.dumps(engine.status().to_json())))


def _same(a: scheduler.Decision, b: scheduler.Decision) -> bool:
    """The same decision; the words of a reason aside (rows leave them empty)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, scheduler.Wait) and isinstance(b, scheduler.Wait):
        return a.blocked_by == b.blocked_by
    return isinstance(a, scheduler.NoFit) or a == b


@pytest.mark.parametrize("row", [pytest.param(r, id=r.name) for r in ROWS])
async def test_the_front_predicts_the_engines_decision(
    row: Row, build: Callable[[Row], tuple[Engine, Any]]
) -> None:
    engine, want_rt = build(row)
    by_engine = engine._decide(want_rt)
    predicted = placement.plan_from_status(_wire(engine), _front_want(row))
    assert _same(by_engine, row.expected), by_engine
    assert _same(predicted, by_engine), (predicted, by_engine)
    # and routing scores the engine by that decision
    view = routing.view_from_status("engine-0", _wire(engine), _front_want(row))
    assert view.compatible == (not isinstance(by_engine, scheduler.NoFit))
    if isinstance(by_engine, scheduler.Evict):
        assert view.evictions_needed == len(by_engine.victims)


async def test_every_field_the_policy_reads_crosses_the_wire(
    build: Callable[[Row], tuple[Engine, Any]]
) -> None:
    """The builder gives the same `Resident` records from /status as the engine plans with."""
    row = Row("all-fields", (
        R("a", 4, measured_gib=3, leases=1, waiters=2, last_used=7.0, load_duration_s=3.5,
          keep_alive_s=60.0, spec={"priority": 3, "group": "g",
                                   "can_coexist_with": ["b", "c"]}),
        R("b", 2, state="loading", measured_gib=1),
        R("p", 1, spec={"pinned": True}),
    ), R("c", 1, state=None), 1, scheduler.NoFit(""))
    engine, _ = build(row)
    front = {r.model: r for r in placement.residents(_wire(engine).models)}
    assert front == {r.model: r for r in engine._residents()}
    assert front["a"] == scheduler.Resident(
        model="a", bytes=3 * GiB, leases=1, priority=3, last_used=7.0, group="g",
        coexist_with=frozenset({"b", "c"}), reload_cost_s=3.5, keep_alive_s=60.0, waiters=2,
    )
    assert front["b"] == scheduler.Resident(model="b", bytes=2 * GiB, leases=1,
                                            keep_alive_s=300.0)
    assert front["p"] == scheduler.Resident(model="p", bytes=1 * GiB, pinned=True)
    status = _wire(engine)
    assert (status.device.total_bytes, status.device.free_bytes) == (8 * GiB, 1 * GiB)
    assert status.scheduler.max_loaded_models is None


async def test_keep_alive_expiry_reads_the_same_view(
    build: Callable[[Row], tuple[Engine, Any]]
) -> None:
    row = Row("expiry", (
        R("a", 1, last_used=NOW - 10, keep_alive_s=5.0),
        R("b", 1, last_used=NOW - 10, keep_alive_s=60.0),
        R("c", 1, last_used=NOW - 10, keep_alive_s=0.0, waiters=1),
    ), R("d", 1, state=None), 5, scheduler.Load("d"))
    engine, _ = build(row)
    assert scheduler.expired(placement.residents(_wire(engine).models), NOW) == ("a",)
    assert scheduler.expired(engine._residents(), NOW) == ("a",)
