"""modelyard's configuration: one documented schema, read from YAML and `MODELYARD_*` variables.

Precedence, highest first: explicit overrides (CLI flags) > environment > YAML file > defaults.
Every option has a default and a one-line description; `config.example.yaml` shows them all and
is loaded by a test, and `modelyard config-schema` prints the JSON schema generated from here.
"""

from __future__ import annotations

import os
import shutil
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

DEMO_MODEL_ID = "smollm2"
DEMO_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_SERVER_VERSION = "11434.0.0"


def cache_dir() -> Path:
    """Where built binaries and downloaded artefacts are cached, outside any checkout."""
    return Path(os.environ.get("MODELYARD_CACHE", Path.home() / ".cache" / "modelyard"))


class _ModelBase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="Name clients use in the `model` field.", min_length=1)
    aliases: list[str] = Field(default_factory=list, description="Other names for this model.")
    health_path: str = Field("/health", description="Readiness route of the child server.")
    extra_args: list[str] = Field(
        default_factory=list, description="Arguments appended to the child's argv."
    )


class LlamaCppModel(_ModelBase):
    """A GGUF model served by a child `llama-server`."""

    backend: Literal["llamacpp"] = "llamacpp"
    path: Path = Field(description="The .gguf file.")
    mmproj: Path | None = Field(None, description="Multimodal projector .gguf, if any.")
    ctx_size: int | None = Field(
        None, gt=0, description="Context size; null uses `default_ctx_size`."
    )
    argv: list[str] | None = Field(
        None,
        description="Replaces the default llama-server command line; `$path $port $host $id "
        "$ctx $ctx_total $parallel $mmproj $llama_server` are substituted.",
    )


class OpenAIServerModel(_ModelBase):
    """Any child command that speaks the OpenAI API (TGI, SGLang, LocalAI, a test fake…)."""

    backend: Literal["openai"] = "openai"
    argv: list[str] = Field(
        description="Command line; `$path $port $host $id $ctx` are substituted.", min_length=1
    )
    path: Path | None = Field(None, description="Optional weights path substituted as `$path`.")
    ctx_size: int | None = Field(None, gt=0, description="Substituted as `$ctx`.")


ModelSpec = Annotated[LlamaCppModel | OpenAIServerModel, Field(discriminator="backend")]

_yaml_file: ContextVar[Path | None] = ContextVar("modelyard_yaml_file", default=None)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="MODELYARD_", extra="forbid", env_nested_delimiter="__"
    )

    home: Path = Field(
        Path.home() / ".modelyard",
        description="Data directory: database, logs and modelyard's own model directory.",
    )
    host: str = Field("127.0.0.1", description="Address the public front binds.")
    port: int = Field(8770, ge=0, le=65535, description="Public port of the front.")
    model_dirs: list[Path] = Field(
        default_factory=list,
        description="Extra directories scanned for GGUF files ($home/models is always scanned).",
    )
    scan_hf_cache: bool = Field(True, description="Also list GGUF files in the HF hub cache.")
    hf_cache_dir: Path | None = Field(
        None, description="HF hub cache; null follows HF_HUB_CACHE / HF_HOME."
    )
    models: list[ModelSpec] = Field(
        default_factory=list, description="Models declared explicitly (they win over discovery)."
    )
    llama_server_path: Path | None = Field(
        None,
        description="llama-server binary (e.g. your CUDA/Vulkan build); null uses the one "
        "`make run` built, then `llama-server` on PATH.",
    )
    default_ctx_size: int = Field(4096, gt=0, description="Context size for GGUF models.")
    llama_server_parallel: int = Field(
        4, gt=0, description="Requests a GGUF model serves at once (llama-server slots); each "
        "gets the full context, so KV-cache memory grows with this.",
    )
    llama_server_threads: int | None = Field(
        None, gt=0, description="`--threads` for llama-server; null lets it choose."
    )
    load_cooldown_s: float = Field(
        300.0, ge=0, description="After a failed load, refuse new loads of that model this long."
    )
    load_stall_timeout_s: float = Field(
        120.0, gt=0, description="A loading child that prints nothing and is not ready this long "
        "is declared stalled (the deadline resets on every log line).",
    )
    load_timeout_s: float = Field(
        1800.0, gt=0, description="Hard ceiling on one load, progress or not."
    )
    stop_grace_s: float = Field(
        10.0, ge=0, description="SIGTERM → SIGKILL grace when stopping a child process."
    )
    log_tail_lines: int = Field(
        40, gt=0, description="Child log lines kept in memory and quoted in load errors."
    )
    engine_start_timeout_s: float = Field(
        60.0, gt=0, description="How long the front waits for an engine process to be ready."
    )
    engine_restart_backoff_s: float = Field(
        1.0, ge=0, description="First delay before restarting a crashed engine (doubles, max 30)."
    )
    single_process: bool = Field(
        False, description="Run the front and one engine in one process."
    )
    devices: Literal["auto", "cpu"] = Field(
        "auto", description="`auto`: one engine per GPU nvidia-smi reports, else one CPU engine."
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Upper bound on one upstream request (read timeout)."
    )

    @field_validator("home", mode="after")
    @classmethod
    def _expand_home(cls, v: Path) -> Path:
        return v.expanduser()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        yaml_file = _yaml_file.get()
        if yaml_file is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
        return tuple(sources)

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    def resolve_llama_server(self) -> Path | None:
        """The llama-server binary to use, or None when there is none to be had."""
        if self.llama_server_path is not None:
            return self.llama_server_path if self.llama_server_path.is_file() else None
        built = cache_dir() / f"llama-server-{LLAMA_SERVER_VERSION}-avx2" / "llama-server"
        if built.is_file():
            return built
        found = shutil.which("llama-server")
        return Path(found) if found else None


def default_config_file(home: Path | None = None) -> Path | None:
    """`--config`, else `$MODELYARD_CONFIG`, else `$MODELYARD_HOME/config.yaml` if it exists."""
    env = os.environ.get("MODELYARD_CONFIG")
    if env:
        return Path(env)
    base = home or Path(os.environ.get("MODELYARD_HOME", Path.home() / ".modelyard"))
    candidate = base.expanduser() / "config.yaml"
    return candidate if candidate.is_file() else None


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Settings from defaults < YAML < environment < overrides (None overrides are ignored)."""
    path = config_file if config_file is not None else default_config_file()
    if path is not None and not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    token = _yaml_file.set(path)
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    finally:
        _yaml_file.reset(token)
