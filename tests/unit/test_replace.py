"""Which startup models and pinned copies front/ops/replace.py loads again: those on an engine
removed at once, on one down past the grace, and on one that came back (a new process)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest

from modelyard.front.ops.replace import DOWN_GRACE_S, Replacer
from modelyard.wire.engines import EngineSet

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


@dataclass
class Engine:
    name: str
    up: bool = True


@dataclass
class Setup:
    engines: list[Engine]
    copies: dict[str, str] = field(default_factory=dict)
    now: float = 0.0

    def replacer(self) -> Replacer:
        provider = SimpleNamespace(view=EngineSet(1, cast(Any, tuple(self.engines))))
        replicas = SimpleNamespace(pinned_placements=lambda: dict(self.copies))
        dispatch = SimpleNamespace(provider=provider, replicas=replicas)
        catalog = SimpleNamespace(settings=SimpleNamespace(engine_restart_backoff_s=1.0))
        self._provider = provider
        return Replacer(cast(Any, dispatch), cast(Any, catalog), clock=lambda: self.now)

    def publish(self, engines: list[Engine]) -> None:
        self.engines = engines
        self._provider.view = EngineSet(2, cast(Any, tuple(engines)))


def test_a_model_on_a_removed_engine_is_lost_at_once() -> None:
    a, b = Engine("engine-0"), Engine("engine-1")
    setup = Setup([a, b], copies={"m#2": "engine-0", "m": "engine-1"})
    replacer = setup.replacer()
    replacer.placed = {"boot": "engine-0", "other": "engine-1"}
    assert replacer.lost() == {}
    setup.publish([b])
    assert replacer.lost() == {"boot": "engine-0", "m#2": "engine-0"}


def test_a_down_engine_loses_its_models_only_past_the_grace() -> None:
    a, b = Engine("engine-0"), Engine("engine-1")
    setup = Setup([a, b])
    replacer = setup.replacer()
    replacer.placed = {"boot": "engine-0"}
    a.up = False
    assert replacer.lost() == {}  # a restart takes a moment
    setup.now = 1.0 + DOWN_GRACE_S - 0.5
    assert replacer.lost() == {}
    setup.now = 1.0 + DOWN_GRACE_S + 0.5
    assert replacer.lost() == {"boot": "engine-0"}


def test_an_engine_back_up_after_being_down_loads_its_models_again() -> None:
    a = Engine("engine-0")
    setup = Setup([a])
    replacer = setup.replacer()
    replacer.placed = {"boot": "engine-0"}
    a.up = False
    assert replacer.lost() == {}
    a.up = True  # a restarted process: its models are gone
    assert replacer.lost() == {"boot": "engine-0"}
    assert replacer.lost() == {}  # once


def test_an_engine_added_again_under_its_name_is_a_new_one() -> None:
    setup = Setup([Engine("engine-0")])
    replacer = setup.replacer()
    replacer.placed = {"boot": "engine-0"}
    assert replacer.lost() == {}
    setup.publish([Engine("engine-0")])
    assert replacer.lost() == {"boot": "engine-0"}
