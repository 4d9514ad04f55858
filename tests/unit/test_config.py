from pathlib import Path

import pytest
from pydantic import ValidationError

from modelyard.config import LlamaCppModel, OpenAIServerModel, Settings, load_settings

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

ROOT = Path(__file__).resolve().parents[2]


def test_example_config_loads_with_every_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MODELYARD_HOME", raising=False)
    settings = load_settings(ROOT / "config.example.yaml")
    assert settings.port == 8770
    assert isinstance(settings.models[0], LlamaCppModel)
    assert settings.models[0].ctx_size == 8192
    assert isinstance(settings.models[1], OpenAIServerModel)
    text = (ROOT / "config.example.yaml").read_text()
    for option in Settings.model_fields:
        assert f"\n{option}:" in text, f"config.example.yaml does not show `{option}`"


def test_every_option_is_documented() -> None:
    for name, field in Settings.model_fields.items():
        assert field.description, f"{name} has no description"


def test_env_overrides_yaml_and_flags_override_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 9001\nload_cooldown_s: 5\n")
    monkeypatch.setenv("MODELYARD_PORT", "9002")
    assert load_settings(cfg).port == 9002
    assert load_settings(cfg).load_cooldown_s == 5
    assert load_settings(cfg, port=9003).port == 9003


def test_home_defaults_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELYARD_HOME", str(tmp_path))
    monkeypatch.delenv("MODELYARD_CONFIG", raising=False)
    settings = load_settings()
    assert settings.home == tmp_path
    assert settings.models_dir == tmp_path / "models"
    assert settings.logs_dir == tmp_path / "logs"


def test_unknown_option_and_bad_backend_are_rejected(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("prot: 1\n")
    with pytest.raises(ValidationError, match="prot"):
        load_settings(cfg)
    cfg.write_text("models: [{id: x, backend: nope, path: /x}]\n")
    with pytest.raises(ValidationError, match="backend"):
        load_settings(cfg)


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_settings(tmp_path / "absent.yaml")


def test_llama_server_path_option(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    assert Settings(llama_server_path=binary).resolve_llama_server() == binary
    assert Settings(llama_server_path=tmp_path / "none").resolve_llama_server() is None


def test_paths_in_a_config_expand_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "model_dirs: [~/gguf]\nmodels: [{id: m, backend: llamacpp, path: ~/m.gguf, "
        "mmproj: ~/p.gguf}]\n"
    )
    settings = load_settings(cfg)
    assert settings.model_dirs == [tmp_path / "gguf"]
    spec = settings.models[0]
    assert isinstance(spec, LlamaCppModel)
    assert (spec.path, spec.mmproj) == (tmp_path / "m.gguf", tmp_path / "p.gguf")
