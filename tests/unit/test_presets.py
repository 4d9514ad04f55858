"""Presets fill in what a request leaves out, and are listed as models of their own."""

from pathlib import Path

import orjson
import pytest

from modelyard.config import LlamaCppModel, Preset, Settings
from modelyard.front.chat.presets import apply_preset, apply_preset_bytes
from modelyard.store.registry import ModelRegistry

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

PRESET = Preset(id="precise", model="base", parameters={"temperature": 0.1, "top_p": 0.9},
                system="Be brief.")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # the preset fills in sampling and a system prompt
        ({"messages": [{"role": "user", "content": "hi"}]},
         {"temperature": 0.1, "top_p": 0.9,
          "messages": [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "hi"}]}),
        # what the request says wins, and its own system prompt stays alone
        ({"temperature": 0.7, "messages": [{"role": "system", "content": "Mine."}]},
         {"temperature": 0.7, "top_p": 0.9, "messages": [{"role": "system", "content": "Mine."}]}),
        # text completions have no messages: only the parameters apply
        ({"prompt": "x"}, {"temperature": 0.1, "top_p": 0.9, "prompt": "x"}),
    ],
)
def test_apply_preset(body: dict[str, object], expected: dict[str, object]) -> None:
    assert apply_preset(PRESET, body) == expected


def test_bytes_that_are_not_a_json_object_pass_unchanged() -> None:
    assert apply_preset_bytes(PRESET, b"not json") == b"not json"
    assert apply_preset_bytes(PRESET, b"[1]") == b"[1]"
    body = orjson.loads(apply_preset_bytes(PRESET, b'{"prompt": "x"}'))
    assert body["temperature"] == 0.1


def test_presets_are_listed_and_a_context_preset_is_a_model_of_its_own(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    settings = Settings(
        home=tmp_path / "home", scan_hf_cache=False,
        models=[LlamaCppModel(id="base", path=gguf, aliases=["b"])],
        presets=[PRESET, Preset(id="long", model="b", ctx_size=16384),
                 Preset(id="orphan", model="gone")],
    )
    registry = ModelRegistry.build(settings)
    names = [name for name, _ in registry.names()]
    assert names == ["base", "b", "precise", "long"]  # the orphan's model does not exist
    precise = registry.resolve("precise")
    assert precise.id == "base" and precise.preset == PRESET  # runs the base model's server
    long = registry.resolve("LONG")
    assert long.id == "long" and isinstance(long.spec, LlamaCppModel)
    assert long.spec.ctx_size == 16384 and long.spec.path == gguf
