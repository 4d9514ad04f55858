"""What a config reload changes: pure functions over two configurations (no I/O, no awaits).

* `diff_specs` sorts models, by id, into changed (their server must restart: argv, path, context,
  flags…), updated (only fields that apply in place changed: aliases, priority, keep-alive…),
  added, removed and unchanged.
* `restart_required` names the settings a running server cannot take up (bind address, home,
  auth, devices…); `keep_running` keeps their running values in a newly read configuration.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from modelyard.config import ModelSpec, Settings
from modelyard.store.registry import ModelRegistry, split_context_variant

# Settings read once at startup (by the bind, the auth gate, the database, the engine processes
# and their supervisor, the logging, the pull queue, the archive, the chat sessions, the thermal
# watch, shutdown): a new value needs a restart.
RESTART_REQUIRED: tuple[str, ...] = (
    "home", "host", "port", "auth", "session_ttl_s", "allowed_hosts", "cors_origins",
    "forwarded_allow_ips",  # handed to uvicorn when it starts
    "max_body_bytes", "files_max_bytes", "batch_max_concurrency", "batch_claim_lease_s",
    "files_max_total_bytes_per_owner", "batch_max_requests", "batches_max_open_per_owner",
    "max_header_bytes", "max_header_count", "header_read_timeout_s",
    "body_read_timeout_s", "client_keep_alive_s", "database_url", "shared_dir",
    "workers",  # the front processes are started once, with the port
    "front_sync_interval_s", "single_process", "devices", "limits_refresh_s",
    "usage_flush_interval_s", "usage_metric_owners", "usage_metric_top_owners",
    "simulate_gpus", "engine_devices", "node_address", "cluster",
    "probe_backend_devices",  # an engine asks its backends once, at start (engine/reach.py)
    "host_ram_cap_bytes", "request_timeout_s", "engine_start_timeout_s",
    "engine_restart_backoff_s", "engine_health_interval_s", "engine_health_timeout_s",
    "engine_health_failures", "engine_heartbeat_timeout_s", "shutdown_grace_s",
    "log_file_max_bytes", "log_file_backups",
    "log_format", "log_buffer_lines", "startup_models", "max_concurrent_pulls",
    "reserve_free_bytes", "archive_retention", "archive_sweep_interval_s", "thermal",
    "activity_max_entries",  # the activity view's ring is sized at start
    "chat_session_max_count", "chat_session_max_bytes", "chat_session_max_total_bytes",
    "chat_session_ttl_s", "chat_session_sweep_interval_s", "chat_session_persist",
    "mcp_servers",  # the tool loop's MCP connections are opened for the front's lifetime
)
# Settings read where they are used, so a reload applies them (to the next load, request,
# placement…). Every option is in exactly one of the two lists (tests/unit/test_config_diff.py).
RELOADABLE: tuple[str, ...] = (
    "max_tool_rounds", "models", "presets", "model_dirs", "scan_hf_cache", "hf_cache_dir",
    "embedding_demo",  # the catalog is rebuilt by a reload: all-minilm comes or goes with it
    "llama_server_path",
    "default_ctx_size", "max_context_variants", "llama_server_parallel", "llama_server_threads",
    "load_cooldown_s",
    "load_stall_timeout_s", "load_timeout_s", "stop_grace_s", "log_tail_lines", "keep_alive_s",
    "max_loaded_models", "warm_tier_bytes", "gguf_read_ahead", "memory_wait_timeout_s",
    "memory_recovery_timeout_s",
    "notify_model_swap", "max_concurrency", "max_queue", "queue_timeout_s", "default_engine",
    "engine_specs", "auto_pull", "archive_service_outputs", "default_max_tokens",
    "replica_scale_up_wait_s", "replica_idle_s",  # read by the front at each scale decision
    "activity_capture_bodies", "activity_capture_max_bytes",  # read at each request
    "fair_share",  # read by the dispatcher at each request (weights, swap share)
    "import_max_depth", "import_max_entries", "import_max_s",  # read at each /admin/import
    "max_scored_prompt_tokens",  # read at each scored /v1/completions request
    "max_choices",  # read at each OpenAI request that asks for n > 1
    "pull_aliases",  # read at each /api/pull of a plain name
)

# Model fields a running server does not depend on: a change applies without a restart.
IN_PLACE_FIELDS = frozenset({
    "aliases", "priority", "keep_alive_s", "pinned", "max_concurrency", "max_queue", "group",
    "can_coexist_with", "vram_bytes", "replicas", "max_replicas",
    "token_ids",  # read by the front at each embeddings request of token ids
})

# Server-wide settings that go into a backend's command line: a change restarts its models.
_LAUNCH_SETTINGS: dict[str, tuple[str, ...]] = {
    "llamacpp": ("llama_server_path", "default_ctx_size", "llama_server_parallel",
                 "llama_server_threads"),
    "openai": ("default_ctx_size",),
}


@dataclass(frozen=True)
class SpecDiff:
    changed: list[str]
    updated: list[str]
    added: list[str]
    removed: list[str]
    unchanged: list[str]

    @property
    def restart(self) -> list[str]:
        """Models whose running server, if any, must stop: changed or removed."""
        return [*self.changed, *self.removed]

    def to_json(self) -> dict[str, list[str]]:
        return {"changed": self.changed, "updated": self.updated, "added": self.added,
                "removed": self.removed, "unchanged": self.unchanged}


def diff_specs(
    old: Mapping[str, Mapping[str, Any]], new: Mapping[str, Mapping[str, Any]]
) -> SpecDiff:
    """Compare model views (id → `spec_view`); every list is sorted."""

    def launch(view: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in view.items() if k not in IN_PLACE_FIELDS}

    changed, updated, unchanged = [], [], []
    for model_id in sorted(old.keys() & new.keys()):
        if launch(old[model_id]) != launch(new[model_id]):
            changed.append(model_id)
        elif old[model_id] != new[model_id]:
            updated.append(model_id)
        else:
            unchanged.append(model_id)
    return SpecDiff(
        changed=changed,
        updated=updated,
        added=sorted(new.keys() - old.keys()),
        removed=sorted(old.keys() - new.keys()),
        unchanged=unchanged,
    )


def spec_view(spec: ModelSpec, settings: Settings) -> dict[str, Any]:
    """What a model runs as: its spec plus the server-wide settings its backend's command line
    uses (JSON values, so two views compare by value)."""
    view = spec.model_dump(mode="json")
    for name in _LAUNCH_SETTINGS.get(spec.backend, ()):
        value = getattr(settings, name)
        view[f"settings.{name}"] = str(value) if value is not None else None
    return view


def spec_views(
    registry: ModelRegistry, settings: Settings, running: Iterable[str] = ()
) -> dict[str, dict[str, Any]]:
    """Every model the registry runs, by id (a preset without its own context runs its base
    model, so it adds nothing here), and the context variants (`<model>@ctx<N>`, never listed)
    among the `running` ids: one restarts with its base, and goes with it."""
    views: dict[str, dict[str, Any]] = {}
    for entry in registry.entries():
        if entry.id not in views:
            views[entry.id] = spec_view(entry.spec, settings)
    for model_id in running:
        variant = registry.get(model_id) if split_context_variant(model_id) else None
        if variant is not None and model_id not in views:
            views[model_id] = spec_view(variant.spec, settings)
    return views


def restart_required(running: Settings, fresh: Settings) -> list[str]:
    """Settings whose value in `fresh` differs from what the running server was started with;
    `running` is that start's configuration as read from the same file and environment."""
    out = [name for name in RESTART_REQUIRED if getattr(running, name) != getattr(fresh, name)]
    for index in sorted(running.engine_specs.keys() | fresh.engine_specs.keys()):
        before, after = running.engine_specs.get(index), fresh.engine_specs.get(index)
        if (before.env if before else {}) != (after.env if after else {}):
            out.append(f"engine_specs.{index}.env")
    return out


def keep_running(fresh: Settings, running: Settings) -> Settings:
    """`fresh`, with the running values of every setting that needs a restart (an engine's
    environment included)."""
    update: dict[str, Any] = {name: getattr(running, name) for name in RESTART_REQUIRED}
    update["engine_specs"] = {
        index: spec.model_copy(update={"env": running.engine_specs[index].env
                                       if index in running.engine_specs else {}})
        for index, spec in fresh.engine_specs.items()
    }
    return fresh.model_copy(update=update)
