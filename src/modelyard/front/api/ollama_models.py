"""Ollama's model listing routes: /api/tags, /api/ps, /api/show, /api/version.

Names are listed in Ollama's tagged form (`smollm2:latest`; a name with a tag keeps it): clients
compare what they list with what they were given. Facts come from the files, never guesses:
capabilities from the GGUF metadata and chat template (front/api/ollama_caps.py), sizes and
residency from the engines' own reports. The listing is built once per registry
(`Catalog.memo`): a request does not re-read GGUF headers from disk. A caller without the admin
scope never sees a local path: /api/show's `FROM` names the model, not its file, and metadata
values that are paths are left out.
"""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard import __version__
from modelyard.errors import InvalidRequest, ModelyardError
from modelyard.front.api.modelfile import PARAMETERS
from modelyard.front.api.ollama_caps import capabilities, gguf_info, model_info
from modelyard.front.chat.translate import rfc3339
from modelyard.front.identity.principal import principal_of
from modelyard.front.state import read_json_object, state_of, validate
from modelyard.store.estimate import safetensors_params
from modelyard.store.gguf import GgufInfo
from modelyard.store.registry import Entry, ModelRegistry, tagged
from modelyard.wire.status import ModelStatus

# Clients gate features on the Ollama version they talk to; we speak this one's API.
OLLAMA_COMPAT_VERSION = "0.12.6"
# What Ollama's /api/ps says of a model kept loaded forever (keep_alive < 0): a time far ahead,
# as Go's time.Now().Add(math.MaxInt64) reads, rather than the zero time clients show as "ago".
FOREVER = "2318-08-20T06:12:44Z"


def _json(payload: Any) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


def _digest(entry: Entry) -> str:
    """A stable identity for the file (path, size, mtime), not a hash of its bytes."""
    st = entry.path.stat() if entry.path is not None and entry.path.exists() else None
    key = f"{entry.path}:{st.st_size if st else 0}:{st.st_mtime_ns if st else 0}:{entry.name}"
    return hashlib.sha256(key.encode()).hexdigest()


def _parameter_size(count: int | None) -> str:
    if not count:
        return ""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}".replace(".0", "")
    return str(count)


def _details(entry: Entry, info: GgufInfo | None) -> dict[str, Any]:
    family = info.architecture if info else ""
    return {
        "parent_model": entry.preset.model if entry.preset is not None else "",
        "format": entry.format,
        "family": family,
        "families": [family] if family else None,
        "parameter_size": _parameter_size(info.parameter_count if info else None),
        "quantization_level": (info.file_type or "") if info else "",
    }


def _modified_at(entry: Entry) -> str:
    try:
        mtime = entry.path.stat().st_mtime if entry.path is not None else 0.0
    except OSError:
        mtime = 0.0
    return datetime.fromtimestamp(mtime, UTC).isoformat().replace("+00:00", "Z")


def _tag(entry: Entry, name: str) -> dict[str, Any]:
    listed = tagged(name)
    return {
        "name": listed,
        "model": listed,
        "modified_at": _modified_at(entry),
        "size": entry.size_bytes or 0,
        "digest": _digest(entry),
        "details": _details(entry, gguf_info(entry)),
    }


def _listing(registry: ModelRegistry) -> list[dict[str, Any]]:
    return [_tag(e, name) for name, e in registry.names()]


def _by_name(registry: ModelRegistry) -> dict[str, dict[str, Any]]:
    return {e.name: _tag(e, e.name) for e in registry.entries()}


async def tags(request: Request) -> Response:
    state = state_of(request)
    return _json({"models": state.catalog.memo("ollama.tags", _listing)})


async def ps(request: Request) -> Response:
    state = state_of(request)
    catalog = state.catalog
    listed = catalog.memo("ollama.by_name", _by_name)
    running: list[dict[str, Any]] = []
    admin = principal_of(request).can("admin")
    for engine in state.dispatch.engines:
        if not engine.up:
            continue
        try:
            status = await engine.status()
        except ModelyardError:
            continue
        # On a CPU engine nothing is in VRAM: Ollama's clients read size_vram > 0 as "on GPU".
        on_gpu = status.device.kind not in (None, "cpu")
        for m in status.models:
            entry = catalog.registry.get(m.model)
            if m.state != "ready" or entry is None:
                continue
            ps_row(running, entry, listed, m, engine.name, on_gpu,
                   catalog.settings.default_ctx_size, admin=admin)
    return _json({"models": running})


def ps_row(out: list[dict[str, Any]], entry: Entry, listed: dict[str, dict[str, Any]],
           m: ModelStatus, engine: str, on_gpu: bool, default_ctx_size: int, *,
           admin: bool = True) -> None:
    """One /api/ps row: `size` what the model holds in memory (its measured or reserved bytes,
    else its file, plus host RAM of a partial offload), `size_vram` the part of it on GPUs
    (never more than `size`); a model on the CPU of an engine with GPUs, `cpu_reason` (a
    client without the admin scope gets it without its details: they name local paths)."""
    row = {k: v for k, v in (listed.get(entry.name) or _tag(entry, entry.name)).items()
           if k != "modified_at"}
    size = m.memory.measured_bytes or m.memory.reserved_bytes or entry.size_bytes or 0
    vram = size if on_gpu else 0
    if m.placement is not None and not m.placement.device_bytes and m.placement.host_bytes:
        # On the CPU of an engine with GPUs (its backend cannot use them): none of it in VRAM.
        vram = 0
        size = m.memory.host_bytes or m.placement.host_bytes
    elif on_gpu and m.placement is not None and m.placement.offloaded:
        # A partial offload: its layers in host RAM are part of `size`, not of `size_vram`
        # (Ollama's clients show the split from these two).
        vram = m.placement.bytes
        size = vram + m.placement.host_bytes
    expires_in = m.expires_in_s
    forever = expires_in is None or (m.keep_alive_s is not None and m.keep_alive_s < 0)
    info = gguf_info(entry)
    row.update({
        "size": size,
        "size_vram": vram,
        "expires_at": FOREVER if forever else rfc3339(time.time() + (expires_in or 0.0)),
        "context_length": _context_length(entry, info, default_ctx_size),
        "engine": engine,
    })
    if m.cpu_reason is not None:  # why it is on the CPU (modelyard's own field)
        row["cpu_reason"] = m.cpu_reason if admin else m.cpu_reason.split(":", 1)[0]
    out.append(row)


def _context_length(entry: Entry, info: GgufInfo | None, default_ctx_size: int) -> int:
    """The context the model runs with: its configured `ctx_size`, else the server's
    `default_ctx_size` for llama-server and OpenAI-server backends (as they start them), else
    what the file says (transformers runs a model's own)."""
    configured = getattr(entry.spec, "ctx_size", None)
    if isinstance(configured, int):
        return configured
    if entry.spec.backend in ("llamacpp", "openai"):
        return default_ctx_size
    return (info.context_length if info else None) or 0


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    name: str | None = None  # older clients send `name`


def _modelfile(entry: Entry, *, admin: bool = True) -> str:
    """Ollama's Modelfile of the entry; `FROM` is its file for an admin (as Ollama shows its
    blob), the model's name for anyone else (a path maps the machine)."""
    source = entry.preset.model if entry.preset else (entry.path if admin else None) or entry.id
    lines = [f"FROM {source}"]
    preset = entry.preset
    if preset is not None:
        if preset.ctx_size is not None:
            lines.append(f"PARAMETER num_ctx {preset.ctx_size}")
        lines += [f"PARAMETER {k} {v}" for k, v in _ollama_names(preset.parameters).items()]
        if preset.system:
            lines.append(f'SYSTEM """{preset.system}"""')
        lines += [f'MESSAGE {m.get("role")} """{m.get("content")}"""' for m in preset.messages]
    return "\n".join(lines) + "\n"


# A preset's request field → the option Ollama names it (max_tokens → num_predict).
_OLLAMA_NAMES = {field: name for name, field in PARAMETERS.items()}


def _ollama_names(parameters: dict[str, Any]) -> dict[str, Any]:
    """A preset's request defaults under Ollama's option names (others keep theirs)."""
    return {_OLLAMA_NAMES.get(k, k): v for k, v in parameters.items()}


def _parameters(entry: Entry) -> str:
    preset = entry.preset
    if preset is None:
        return ""
    params = _ollama_names(preset.parameters)
    if preset.ctx_size is not None:
        params["num_ctx"] = preset.ctx_size
    return "\n".join(f"{k:<30} {v}" for k, v in params.items())


async def show(request: Request) -> Response:
    state = state_of(request)
    req = validate(ShowRequest, await read_json_object(request))
    name = req.model or req.name
    if not name:
        raise InvalidRequest("`model` is required", param="model")
    entry = state.catalog.registry.resolve(name)
    admin = principal_of(request).can("admin")
    if entry.format == "safetensors" and entry.path is not None:
        return _json(_show_safetensors(entry, admin=admin))
    info = gguf_info(entry)
    template = entry.template or ((info.chat_template or "") if info else "")
    body: dict[str, Any] = {
        "modelfile": _modelfile(entry, admin=admin),
        "parameters": _parameters(entry),
        "template": template,
        "system": (entry.preset.system or "") if entry.preset else "",
        "details": _details(entry, info),
        "model_info": model_info(info) if admin else without_paths(model_info(info)),
        "capabilities": capabilities(entry),
        "modified_at": _modified_at(entry),
    }
    if entry.preset is not None and entry.preset.messages:
        body["messages"] = entry.preset.messages
    return _json(body)


def looks_like_a_path(value: Any) -> bool:
    """A local file or directory name (`/…`, `~/…`, `./…`, `C:\\…`), not a hub id or a URL."""
    return isinstance(value, str) and (
        value.startswith(("/", "~", "./", "../", "\\"))
        or (len(value) > 2 and value[1] == ":" and value[2] in "\\/"))


def without_paths(metadata: dict[str, Any]) -> dict[str, Any]:
    """`metadata` (a GGUF's keys, a config.json) without the values that are local paths,
    nested objects included (a config.json's `_name_or_path` is often the directory it was
    saved from)."""
    return {k: without_paths(v) if isinstance(v, dict) else v
            for k, v in metadata.items() if not looks_like_a_path(v)}


def _show_safetensors(entry: Entry, *, admin: bool = True) -> dict[str, Any]:
    """/api/show for a Hugging Face repo: its config.json is the metadata."""
    assert entry.path is not None
    try:
        config = orjson.loads((entry.path / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        config = {}
    params = 0
    dtypes: set[str] = set()
    for shard in sorted(entry.path.glob("*.safetensors")):
        try:
            counts = safetensors_params(shard)
        except (OSError, ValueError):
            continue
        params += sum(counts.values())
        dtypes |= set(counts)
    family = str(config.get("model_type") or "")
    details = {
        "parent_model": "", "format": "safetensors", "family": family,
        "families": [family] if family else None, "parameter_size": _parameter_size(params),
        "quantization_level": ",".join(sorted(dtypes)),
    }
    return {"modelfile": _modelfile(entry, admin=admin), "parameters": _parameters(entry),
            "template": "", "details": details,
            "model_info": config if admin else without_paths(config),
            "capabilities": capabilities(entry),
            "modified_at": _modified_at(entry)}


async def version(_: Request) -> Response:
    return _json({"version": OLLAMA_COMPAT_VERSION, "modelyard": __version__})


routes = [
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/version", version, methods=["GET"]),
]
