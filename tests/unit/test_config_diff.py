"""What a config reload changes: the spec diff, the restart-only settings, the field path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from modelyard.config import LlamaCppModel, OpenAIServerModel, Settings
from modelyard.front.ops.reload import field_path
from modelyard.store.config_diff import (
    IN_PLACE_FIELDS,
    RELOADABLE,
    RESTART_REQUIRED,
    diff_specs,
    keep_running,
    restart_required,
    spec_view,
    spec_views,
)
from modelyard.store.registry import Entry, ModelRegistry

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def fake(model_id: str, *flags: str, **fields: Any) -> OpenAIServerModel:
    return OpenAIServerModel(id=model_id, argv=["fake", "--port", "$port", *flags], **fields)


def views(*specs: Any, settings: Settings | None = None) -> dict[str, dict[str, Any]]:
    s = settings or Settings(home=Path("/nonexistent"))
    return {spec.id: spec_view(spec, s) for spec in specs}


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        pytest.param([], [], {}, id="nothing"),
        pytest.param([fake("a")], [fake("a")], {"unchanged": ["a"]}, id="same"),
        pytest.param([fake("a")], [fake("a", "--slow")], {"changed": ["a"]}, id="argv"),
        pytest.param([fake("a")], [fake("a", ctx_size=8)], {"changed": ["a"]}, id="ctx"),
        pytest.param([fake("a")], [fake("a", extra_args=["-x"])], {"changed": ["a"]},
                     id="extra_args"),
        pytest.param([fake("a")], [fake("a", engine=1)], {"changed": ["a"]}, id="pinned engine"),
        pytest.param([fake("a")], [fake("a", requires=["cuda"])], {"changed": ["a"]},
                     id="requires"),
        pytest.param([fake("a")], [fake("a", aliases=["b"], priority=3, keep_alive_s=5)],
                     {"updated": ["a"]}, id="in place only"),
        pytest.param([fake("a")], [fake("a", aliases=["b"], health_path="/ok")],
                     {"changed": ["a"]}, id="in place and launch"),
        pytest.param([fake("a")], [fake("b")], {"added": ["b"], "removed": ["a"]}, id="renamed"),
        pytest.param(
            [fake("c"), fake("a"), fake("b")],
            [fake("b", "--x"), fake("a"), fake("d"), fake("c", pinned=True)],
            {"changed": ["b"], "updated": ["c"], "added": ["d"], "unchanged": ["a"]},
            id="mixed, sorted",
        ),
    ],
)
def test_diff_specs(old: list[Any], new: list[Any], expected: dict[str, list[str]]) -> None:
    diff = diff_specs(views(*old), views(*new))
    want = {k: expected.get(k, []) for k in ("changed", "updated", "added", "removed",
                                             "unchanged")}
    assert diff.to_json() == want
    assert diff.restart == [*want["changed"], *want["removed"]]


def test_in_place_fields_are_model_fields() -> None:
    assert set(OpenAIServerModel.model_fields) >= IN_PLACE_FIELDS


def test_a_backend_setting_restarts_only_the_models_that_use_it() -> None:
    gguf = LlamaCppModel(id="g", path=Path("/m/g.gguf"), ctx_size=None)
    other = fake("o", ctx_size=512)
    before = Settings(home=Path("/h"), llama_server_parallel=4)
    after = Settings(home=Path("/h"), llama_server_parallel=2)
    diff = diff_specs(views(gguf, other, settings=before), views(gguf, other, settings=after))
    assert diff.changed == ["g"] and diff.unchanged == ["o"]
    path_before = Settings(home=Path("/h"), llama_server_path=Path("/a/llama-server"))
    path_after = Settings(home=Path("/h"), llama_server_path=Path("/b/llama-server"))
    assert diff_specs(views(gguf, settings=path_before),
                      views(gguf, settings=path_after)).changed == ["g"]


def test_spec_views_count_a_preset_without_its_own_context_once(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    base = fake("a")
    registry = ModelRegistry([Entry(base, "config"), Entry(fake("p", ctx_size=64), "config")])
    assert set(spec_views(registry, settings)) == {"a", "p"}


def test_restart_required_names_settings_a_running_server_cannot_change() -> None:
    running = Settings(home=Path("/h"), port=8770, engine_specs={0: {"env": {"A": "1"}}})
    same = Settings(home=Path("/h"), port=8770, keep_alive_s=5,
                    engine_specs={0: {"env": {"A": "1"}, "capabilities": ["cuda"]}})
    assert restart_required(running, same) == []
    moved = Settings(home=Path("/other"), port=9000, auth="required", devices="cpu",
                     engine_specs={0: {"env": {"A": "2"}}, 1: {"env": {"B": "1"}}})
    assert restart_required(running, moved) == [
        "home", "port", "auth", "devices", "engine_specs.0.env", "engine_specs.1.env"]


def test_every_option_says_whether_a_reload_applies_it() -> None:
    """A new option must be placed: read where it is used (RELOADABLE), or once at startup
    (RESTART_REQUIRED, reported by a reload instead of silently ignored)."""
    restart, reloadable = set(RESTART_REQUIRED), set(RELOADABLE)
    assert not restart & reloadable
    assert restart | reloadable == set(Settings.model_fields), (
        "classify in store/config_diff.py: "
        f"{sorted(set(Settings.model_fields) - restart - reloadable)}")


def test_keep_running_keeps_restart_only_values_and_takes_the_rest() -> None:
    running = Settings(home=Path("/h"), port=1234, engine_specs={0: {"env": {"A": "1"}}})
    fresh = Settings(home=Path("/elsewhere"), port=8770, keep_alive_s=7,
                     models=[fake("a").model_dump()],
                     engine_specs={0: {"env": {"A": "2"}, "capabilities": ["cuda"]},
                                   1: {"env": {"B": "1"}}})
    kept = keep_running(fresh, running)
    assert kept.home == Path("/h") and kept.port == 1234
    assert kept.keep_alive_s == 7 and [m.id for m in kept.models] == ["a"]
    assert kept.engine_specs[0].env == {"A": "1"} and kept.engine_specs[0].capabilities == ["cuda"]
    assert kept.engine_specs[1].env == {}


def _loc_of(config: dict[str, Any]) -> tuple[int | str, ...]:
    with pytest.raises(ValidationError) as info:
        Settings.model_validate(config)
    return tuple(info.value.errors()[0]["loc"])


def test_field_path_drops_the_backend_tag() -> None:
    models = [fake("a").model_dump(), fake("b").model_dump(), {**fake("c").model_dump(),
                                                               "ctx_size": -1}]
    assert field_path(_loc_of({"models": models})) == "models.2.ctx_size"
    assert field_path(_loc_of({"bogus": 1})) == "bogus"
    assert field_path(_loc_of({"engine_specs": {"0": {"max_loaded_models": 0}}})) == (
        "engine_specs.0.max_loaded_models")
    assert field_path(()) == "config"
