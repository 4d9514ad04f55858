import pytest

from modelyard.front.dispatch.routing import EngineView, pick_engine

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

E0, E1, E2 = "engine-0", "engine-1", "engine-2"


@pytest.mark.parametrize(
    ("engines", "pinned", "default", "expected"),
    [
        # pinned wins when it can serve; a pin that cannot serve gives nothing
        ([EngineView(E0), EngineView(E1, resident=frozenset({"m"}))], E0, E1, E0),
        ([EngineView(E0, up=False), EngineView(E1)], E0, None, None),
        ([EngineView(E0, compatible=False), EngineView(E1)], E0, None, None),
        # resident beats default; among residents the least queued
        ([EngineView(E0), EngineView(E1, resident=frozenset({"m"}))], None, E0, E1),
        (
            [EngineView(E0, resident=frozenset({"m"}), queued=5),
             EngineView(E1, resident=frozenset({"m"}), queued=1)],
            None, None, E1,
        ),
        # resident on a down engine does not count
        ([EngineView(E0, up=False, resident=frozenset({"m"})), EngineView(E1)], None, E1, E1),
        # default next
        ([EngineView(E0, queued=9), EngineView(E1)], None, E0, E0),
        # default down: least evictions, then least queued
        (
            [EngineView(E0, up=False), EngineView(E1, evictions_needed=1),
             EngineView(E2, evictions_needed=0, queued=3)],
            None, E0, E2,
        ),
        ([EngineView(E1, queued=2), EngineView(E2, queued=1)], None, None, E2),
        # the files of the model: after pin and residency, before default and load
        ([EngineView(E0, has_files=False), EngineView(E1, queued=9)], None, E0, E1),
        ([EngineView(E0, has_files=False), EngineView(E1, evictions_needed=3)], None, None, E1),
        ([EngineView(E0, has_files=False, resident=frozenset({"m"})), EngineView(E1)],
         None, None, E0),
        ([EngineView(E0, has_files=False), EngineView(E1)], E0, None, E0),
        # nobody has them: every usable engine is a candidate (it pulls them or says why)
        ([EngineView(E0, has_files=False), EngineView(E1, has_files=False, queued=1)],
         None, E1, E1),
        ([EngineView(E0, has_files=False, queued=2),
          EngineView(E1, has_files=False, up=False), EngineView(E2, compatible=False)],
         None, None, E0),
        # nothing usable
        ([EngineView(E0, up=False)], None, E0, None),
        ([], None, None, None),
    ],
)
def test_routing_order(
    engines: list[EngineView], pinned: str | None, default: str | None, expected: str | None
) -> None:
    assert pick_engine(engines, "m", pinned=pinned, default=default) == expected


def test_a_cold_copy_avoids_the_engines_of_its_siblings() -> None:
    """A replica's copy goes to an engine without a sibling (default included), unless that
    costs evictions the sibling's engine does not need."""
    two = [EngineView(E0), EngineView(E1, queued=3)]
    assert pick_engine(two, "m#2", avoid=frozenset({E0})) == E1
    assert pick_engine(two, "m#2", default=E0, avoid=frozenset({E0})) == E1
    crowded = [EngineView(E0), EngineView(E1, evictions_needed=1)]
    assert pick_engine(crowded, "m#2", avoid=frozenset({E0})) == E0
