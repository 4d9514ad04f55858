"""The llama.cpp backend: the command line that serves one GGUF model with `llama-server`."""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Sequence
from pathlib import Path

from modelyard.config import LlamaCppModel, Settings
from modelyard.errors import BackendUnavailable
from modelyard.placement.devices import Placement
from modelyard.store.kinds import gguf_kind
from modelyard.store.llama_options import field_args
from modelyard.store.registry import served_name

# Every layer on the devices: llama.cpp clamps the count to the model's, and older builds that a
# user points `llama_server_path` at do not know the word "all".
ALL_LAYERS = "999"

# The spellings of each flag the placement renders (short, long, aliases): a user's `extra_args`
# that name one of them win, and ours is left out (llama.cpp would take the last, silently).
_FLAGS: dict[str, tuple[str, ...]] = {
    "--n-gpu-layers": ("-ngl", "--gpu-layers", "--n-gpu-layers"),
    "--split-mode": ("-sm", "--split-mode"),
    "--tensor-split": ("-ts", "--tensor-split"),
    "--main-gpu": ("-mg", "--main-gpu"),
    "--fit": ("-fit", "--fit"),
    "--spec-draft-ngl": ("-ngld", "--spec-draft-ngl", "--gpu-layers-draft",
                         "--n-gpu-layers-draft"),
    "--spec-draft-device": ("-devd", "--spec-draft-device", "--device-draft"),
}

# The first device the child sees, by llama.cpp's name for it: the engine names a placement's
# devices in CUDA_VISIBLE_DEVICES, so the target's main device (`--main-gpu 0`) is CUDA0.
MAIN_DEVICE = "CUDA0"

# Fixed slots, each with its own KV cache of the full context (as Ollama's num_parallel does):
# llama-server's default (automatic slots sharing one unified cache) kept discarding cached prompts
# once more requests than slots were in flight — 7 req/s at 8 concurrent 1-token requests on the
# demo model against 59 with this layout. `$ctx_total` is the context times the slots.
# `--slot-save-path` lets the front save a chat session's KV after each turn and restore it into
# the session's slot before the next (front/chat/sessions/kv.py): ~15 ms against seconds of prefill.
DEFAULT_ARGV = [
    "$llama_server",
    "--model", "$path",
    "--host", "$host",
    "--port", "$port",
    "--alias", "$id",
    "--ctx-size", "$ctx_total",
    "--parallel", "$parallel",
    "--no-kv-unified",
    "--jinja",
    "--no-webui",
    "--slot-save-path", "$slot_dir",
    # The load's key, from a private file (engine/backends/keys.py): not in the process list.
    "--api-key-file", "$api_key_file",
]


def placement_values(placement: Placement | None) -> dict[str, str]:
    """`$n_gpu_layers $split_mode $tensor_split` for a placement (what a user's argv template
    gets). No placement (a CPU engine): no layer on a GPU, no split."""
    if placement is None or not placement.devices:
        return {"n_gpu_layers": "0", "split_mode": "none", "tensor_split": ""}
    layers = placement.gpu_layers
    split = len(placement.devices) > 1
    # Proportions by layers when the plan split by layers, else by bytes (llama.cpp normalizes).
    shares = placement.layers if len(placement.layers) == len(placement.devices) else tuple(
        b for _, b in placement.device_bytes)
    return {
        "n_gpu_layers": str(layers) if layers is not None else ALL_LAYERS,
        "split_mode": "layer" if split else "none",
        "tensor_split": ",".join(str(n) for n in shares) if split else "",
    }


@functools.cache
def _knows_fit(binary: Path, mtime_ns: int) -> bool:
    """Whether this build has `--fit` (llama.cpp added it in late 2025; an older build that
    `llama_server_path` names would refuse to start with it). Unknown: assume it has."""
    try:
        done = subprocess.run([str(binary), "--help"], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return True
    text = done.stdout + done.stderr
    if "--n-gpu-layers" not in text:  # not llama-server's help: nothing to judge by
        return True
    return "--fit" in text


def knows_fit(binary: Path | None) -> bool:
    if binary is None:
        return True
    try:
        return _knows_fit(binary, binary.stat().st_mtime_ns)
    except OSError:
        return True


def placement_args(
    placement: Placement | None, user_args: Sequence[str] = (), *, fit_flag: bool = True
) -> list[str]:
    """The flags that put a placement's load where the ledger planned it.

    The child sees only the placement's devices (CUDA_VISIBLE_DEVICES), numbered 0..k-1, so the
    main GPU is always 0. `--fit off`: llama-server would otherwise move layers and shrink the
    context to fit what it finds free, behind the ledger's back. A flag the user passed in
    `user_args` (any spelling) is theirs: ours is skipped."""
    if placement is None or not placement.devices:
        return []
    values = placement_values(placement)
    ours = [("--n-gpu-layers", values["n_gpu_layers"]), ("--split-mode", values["split_mode"])]
    if values["tensor_split"]:
        ours.append(("--tensor-split", values["tensor_split"]))
    ours.append(("--main-gpu", "0"))
    if fit_flag:  # an older build has no automatic fitting to turn off
        ours.append(("--fit", "off"))
    given = {a.split("=", 1)[0] for a in user_args}
    out: list[str] = []
    for flag, value in ours:
        if not given.intersection(_FLAGS[flag]):
            out += [flag, value]
    return out


def llama_server_argv(
    spec: LlamaCppModel, settings: Settings, placement: Placement | None = None
) -> tuple[list[str], dict[str, str]]:
    """The argv template and the values it needs (apart from `$port`, chosen at start).

    `placement` (the engine's, told before start) adds the device flags to the default command
    line; a user's `argv` template gets them only as `$n_gpu_layers $split_mode $tensor_split`."""
    binary = settings.resolve_llama_server()
    uses_binary = spec.argv is None or any("$llama_server" in a for a in spec.argv)
    if binary is None and uses_binary:
        wanted = settings.llama_server_path or "llama-server"
        raise BackendUnavailable(
            f"no llama-server binary for GGUF model '{spec.id}': {wanted} not found. Run "
            "`make run` (it builds one) or set `llama_server_path` to your own build.",
            model=spec.id,
        )
    argv = list(spec.argv or DEFAULT_ARGV)
    if spec.argv is None:
        if spec.mmproj is not None:
            argv += ["--mmproj", "$mmproj"]
        if spec.chat_template_file is not None:
            argv += ["--chat-template-file", "$chat_template"]
        if settings.llama_server_threads is not None:
            argv += ["--threads", str(settings.llama_server_threads)]
        # KV cache types and flash attention: the memory estimate reads the same flags
        # (store/llama_options.py), and those a user put in extra_args.
        argv += field_args(spec)
        # An embedding or reranking GGUF (its pooling type, store/kinds.py) needs the matching
        # mode, or llama-server answers /v1/embeddings and /v1/rerank with a 501.
        kind = gguf_kind(spec.path)
        if kind == "embedding":
            argv += ["--embeddings"]
        elif kind == "rerank":
            argv += ["--reranking"]
        # Asked here even without a placement: the engine builds a backend in a worker
        # thread, and place() (on its event loop) then finds the answer cached.
        argv += placement_args(placement, spec.extra_args, fit_flag=knows_fit(binary))
        argv += draft_args(spec, placement)
    ctx = spec.ctx_size or settings.default_ctx_size
    values = {
        "llama_server": str(binary or ""),
        "path": str(spec.path),
        "mmproj": str(spec.mmproj or ""),
        "chat_template": str(spec.chat_template_file or ""),
        "slot_dir": str(settings.session_kv_dir),
        "id": served_name(spec.id),
        "ctx": str(ctx),
        "parallel": str(settings.llama_server_parallel),
        "ctx_total": str(ctx * settings.llama_server_parallel),
        **placement_values(placement),
        "draft": str(spec.draft_model or ""),
    }
    return argv + spec.extra_args, values


def draft_args(spec: LlamaCppModel, placement: Placement | None = None) -> list[str]:
    """Speculative decoding with `spec.draft_model` (a path by now: the engine resolves a catalog
    id before it builds the backend, store/draft.py). The pinned llama-server loads a draft with
    `--model-draft` but drafts nothing until `--spec-type draft-simple` asks it to; `--metrics`
    exposes its draft counters, which the engine reads after requests (engine/speculative.py).

    On GPUs (a placement: the child sees GPUs) the draft follows the target's main device:
    all its layers there (`--spec-draft-ngl`; its default `auto` fits by what it finds free,
    behind the ledger's back, and a partial offload of the target must not push the small draft
    to the CPU, where it would cost more than it saves), and on a split only that device
    (`--spec-draft-device`; by default the draft follows the target's devices and its
    `--tensor-split`, a hop between GPUs per drafted token). The estimate counts the draft on
    the placement's first device. A flag the user put in `extra_args` wins."""
    if spec.draft_model is None:
        return []
    args = ["--model-draft", "$draft", "--spec-type", "draft-simple", "--metrics"]
    if placement is not None and placement.devices:
        given = {a.split("=", 1)[0] for a in spec.extra_args}
        ours = [("--spec-draft-ngl", ALL_LAYERS)]
        if len(placement.devices) > 1:
            ours.append(("--spec-draft-device", MAIN_DEVICE))
        for flag, device_value in ours:
            if not given.intersection(_FLAGS[flag]):
                args += [flag, device_value]
    for flag, value in (("--spec-draft-n-max", spec.draft_max),
                        ("--spec-draft-n-min", spec.draft_min),
                        ("--spec-draft-p-min", spec.draft_p_min)):
        if value is not None:
            args += [flag, str(value)]
    return args


def binary_version(binary: Path) -> str | None:
    """`llama-server --version` output's first line (for /diag)."""
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (done.stdout + done.stderr).strip().splitlines()
    return next((ln for ln in lines if "version" in ln), lines[0] if lines else None)
