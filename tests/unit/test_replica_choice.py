"""Replicas (front/dispatch/replicas.py, store/registry.py): the copy a request goes to, when a
copy is added, and what a copy is in the registry. Pure functions, tested as tables."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import ValidationError

from modelyard.config import Settings
from modelyard.front.dispatch.replicas import Replicas, home_copy, next_copy, pick_copy
from modelyard.store.registry import Entry, ModelRegistry, served_name, split_replica_name

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

COPIES = ["m", "m#2", "m#3"]


@pytest.mark.parametrize(
    ("work", "prefer", "expected"),
    [
        ({}, None, "m"),  # all idle: the first
        ({"m": 2, "m#2": 1, "m#3": 1}, None, "m#2"),  # least work, the first on a tie
        ({"m": 0, "m#2": 5}, "m#2", "m#2"),  # a session stays on its copy, busy or not
        ({"m": 3, "m#2": 0}, "m#9", "m#2"),  # its copy is gone: it moves to the least busy
    ],
)
def test_pick_copy(work: dict[str, int], prefer: str | None, expected: str) -> None:
    assert pick_copy(COPIES, work, prefer) == expected


def test_a_sessions_home_copy_is_a_function_of_its_id() -> None:
    """Several fronts: each picks a new session's copy from its id alone, the same on every
    front (so the KV it left on a copy is found there), spread over the pinned copies."""
    homes = {sid: home_copy(sid, COPIES, pinned=3) for sid in (f"s{i}" for i in range(300))}
    assert homes == {sid: home_copy(sid, list(reversed(COPIES)), pinned=3) for sid in homes}
    spread = {copy: list(homes.values()).count(copy) for copy in COPIES}
    assert all(60 < n < 140 for n in spread.values()), spread
    # only pinned copies (which every front has) are homes; an extra one is this front's own
    assert {home_copy(sid, COPIES, pinned=2) for sid in homes} == {"m", "m#2"}
    # a third copy added takes some sessions and moves none between the other two
    two = {sid: home_copy(sid, COPIES[:2], pinned=2) for sid in homes}
    assert all(homes[s] in (two[s], "m#3") for s in homes)


@pytest.mark.parametrize(
    ("members", "copies", "loading", "expected"),
    [
        (["m"], 2, False, "m#2"),
        (["m", "m#2"], 2, False, None),  # at max_replicas
        (["m"], 3, True, None),  # one load at a time
        (["m", "m#3"], 3, False, "m#2"),  # the lowest k that is not a member
        (["m"], 1, False, None),  # no replicas
    ],
)
def test_next_copy(members: list[str], copies: int, loading: bool, expected: str | None) -> None:
    assert next_copy("m", members, copies, loading) == expected


def _registry(tmp_path: Path, **fields: object) -> tuple[Settings, ModelRegistry]:
    settings = Settings(home=tmp_path, scan_hf_cache=False, embedding_demo=False, models=[
        {"id": "m", "backend": "openai", "argv": ["x", "$id"], "aliases": ["mm"], **fields}])
    return settings, ModelRegistry.build(settings)


def test_a_copy_is_a_model_of_its_own_never_listed(tmp_path: Path) -> None:
    _, registry = _registry(tmp_path, replicas=2, max_replicas=3)
    base, pinned, extra = (registry.get(n) for n in ("m", "m#2", "m#3"))
    assert base is not None and pinned is not None and extra is not None
    assert base.spec.pinned and pinned.spec.pinned and not extra.spec.pinned
    assert (pinned.id, pinned.spec.aliases, pinned.spec.replicas) == ("m#2", [], 1)
    assert registry.get("mm#2") is pinned  # through an alias too
    for beyond in ("m#4", "m#1", "m#02", "m#", "m#2#2"):
        assert registry.get(beyond) is None, beyond
    assert [n for n, _ in registry.names()] == ["m", "mm"]
    assert split_replica_name("a#b#3") == ("a#b", 3)
    assert served_name("m#2") == served_name("m") == "m"


def test_no_copies_without_replicas(tmp_path: Path) -> None:
    _, registry = _registry(tmp_path)
    entry = registry.get("m")
    assert entry is not None and not entry.spec.pinned
    assert registry.get("m#2") is None


def test_replica_options_are_checked() -> None:
    with pytest.raises(ValidationError, match="max_replicas"):
        Settings(models=[{"id": "m", "backend": "openai", "argv": ["x"], "replicas": 3,
                          "max_replicas": 2}])
    with pytest.raises(ValidationError, match="replicas"):
        Settings(models=[{"id": "s", "backend": "service", "url": "http://x", "replicas": 2}])


def test_balance_counts_requests_chosen_but_not_queued_yet(tmp_path: Path) -> None:
    """A burst chooses its copies before any of it is queued: each choice counts at once, and
    a request over gives its count back (once, however often it is told)."""
    settings, registry = _registry(tmp_path, replicas=2)
    replicas = Replicas(lambda: settings, lambda: registry)
    entry = registry.resolve("m")

    async def burst() -> None:
        chosen = [replicas.choose(entry) for _ in range(4)]
        assert [e.id for e, _ in chosen] == ["m", "m#2", "m", "m#2"]
        for _, over in chosen[:2]:
            assert over is not None
            over()
            over()
        assert replicas.choose(entry)[0].id == "m"
        assert [c["work"] for c in replicas.stats()["m"]["copies"]] == [2, 1]
        await replicas.close()

    asyncio.run(burst())


def test_a_copy_asks_the_engine_to_avoid_its_siblings_devices() -> None:
    """An engine over several devices places a copy away from the other copies (Want's
    `avoid_devices`): the devices of the model's other copies, nobody else's."""
    from modelyard.engine.placement_flow import sibling_devices
    from modelyard.placement.devices import Placement
    from modelyard.wire.status import ModelStatus

    def on(model: str, *devices: int) -> ModelStatus:
        return ModelStatus(model, "ready", placement=Placement(tuple((d, 1) for d in devices)))

    placed = [on("m", 0), on("m#3", 2, 3), on("other", 1), ModelStatus("m#4", "loading")]
    assert sibling_devices("m#2", placed) == {0, 2, 3}
    assert sibling_devices("m", placed) == {2, 3}
    assert sibling_devices("other", placed) == frozenset()


def test_a_reload_that_lowers_max_replicas_stops_routing_to_copies_beyond_it(
    tmp_path: Path,
) -> None:
    """A copy beyond the new `max_replicas` no longer resolves: routing to it would fail."""
    settings, registry = _registry(tmp_path, max_replicas=3)
    current = {"registry": registry}
    replicas = Replicas(lambda: settings, lambda: current["registry"])

    async def run() -> None:
        entry = registry.resolve("m")
        held = [replicas.choose(entry) for _ in range(2)]  # both on `m`: one copy only yet
        members = replicas._copies(entry)
        assert members is not None
        members.members += ["m#2", "m#3"]  # as two scale-ups leave them
        _, current["registry"] = _registry(tmp_path / "reloaded", max_replicas=2)
        lowered = current["registry"].resolve("m")
        chosen = {replicas.choose(lowered)[0].id for _ in range(4)}
        assert chosen == {"m", "m#2"}
        for _, over in held:
            assert over is not None
            over()
        await replicas.close()

    asyncio.run(run())


def test_a_waiting_request_moves_to_a_copy_that_joins_and_leaves_its_queue() -> None:
    from modelyard.front.dispatch.queueing import Limits, ModelQueues
    from modelyard.front.dispatch.replicas import MovedToCopy, unless_moved

    async def run() -> None:
        queues = ModelQueues()
        limits = Limits(1, 8)
        held = await queues.acquire("m", limits)
        moved: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(unless_moved(queues.acquire("m", limits), moved))
        while queues.queued("m") == 0:  # yield to the loop until it has queued
            await asyncio.sleep(0)
        moved.set_result("m#2")
        with pytest.raises(MovedToCopy) as info:
            await waiting
        assert info.value.copy == "m#2" and queues.queued("m") == 0
        # not moved: the slot comes when the holder releases it
        stays = asyncio.ensure_future(unless_moved(
            queues.acquire("m", limits), asyncio.get_running_loop().create_future()))
        while queues.queued("m") == 0:
            await asyncio.sleep(0)
        held.release()
        (await stays).release()
        assert queues.running("m") == 0

    asyncio.run(run())


def test_a_pinned_copy_that_cannot_load_at_start_takes_no_requests(tmp_path: Path) -> None:
    """Its pinned siblings never give the memory back: requests sent there would only wait."""
    from modelyard.errors import InsufficientMemory

    settings, registry = _registry(tmp_path, replicas=3)
    replicas = Replicas(lambda: settings, lambda: registry)

    async def load(entry: Entry, keep_alive_s: float | None) -> str:
        if entry.id == "m#3":
            raise InsufficientMemory("no room for m#3", model=entry.id)
        return "engine-0" if entry.id == "m" else "engine-1"

    async def run() -> None:
        replicas.load = load
        await replicas.load_pinned()
        entry = registry.resolve("m")
        assert {replicas.choose(entry)[0].id for _ in range(6)} == {"m", "m#2"}
        assert [(c["model"], c["engine"]) for c in replicas.stats()["m"]["copies"]] == [
            ("m", "engine-0"), ("m#2", "engine-1")]
        await replicas.close()

    asyncio.run(run())
