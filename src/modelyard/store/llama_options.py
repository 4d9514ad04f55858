"""The llama-server options that change how much memory a GGUF model takes: the KV cache types,
flash attention, the context and slots, the micro-batch.

They come from a model's config fields (rendered into the default argv by
engine/backends/llamacpp.py) and from whatever the user wrote into `extra_args` or a custom
`argv`: llama-server takes the last occurrence of an option, so the estimate reads the command
line the child really gets, in the same order, and counts what a user put there by hand too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from modelyard.config import LlamaCppModel, Settings

# Spellings llama-server accepts (its --help; `--opt=value` as well as `--opt value`).
_CACHE_K = ("--cache-type-k", "-ctk")
_CACHE_V = ("--cache-type-v", "-ctv")
_FLASH = ("--flash-attn", "-fa")
_CTX = ("--ctx-size", "-c")
_PARALLEL = ("--parallel", "-np")
_UBATCH = ("--ubatch-size", "-ub")
_FLASH_VALUES = {"on": "on", "enabled": "on", "1": "on", "true": "on",
                 "off": "off", "disabled": "off", "0": "off", "false": "off",
                 "auto": "auto", "-1": "auto"}
DEFAULT_UBATCH = 512  # llama-server's default --ubatch-size


@dataclass(frozen=True)
class LlamaMemoryOptions:
    """What a llama-server child will run with, as far as memory goes."""

    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str = "auto"  # on | off | auto (llama-server's default)
    ctx_per_slot: int = 4096
    slots: int = 1
    ubatch: int = DEFAULT_UBATCH


def field_args(spec: LlamaCppModel) -> list[str]:
    """The flags of the model's cache and attention fields, for the default argv."""
    args: list[str] = []
    if spec.cache_type_k is not None:
        args += ["--cache-type-k", spec.cache_type_k]
    if spec.cache_type_v is not None:
        args += ["--cache-type-v", spec.cache_type_v]
    if spec.flash_attn is not None:
        args += ["--flash-attn", spec.flash_attn]
    return args


def _int(value: str | None) -> int | None:
    try:
        n = int(value) if value is not None else None
    except ValueError:
        return None
    return n if n is not None and n > 0 else None


def parse_args(args: Sequence[str]) -> dict[str, str]:
    """The memory options found in `args`, by canonical name; the last occurrence wins.

    A bare `-fa` (older llama-server: a switch) means on. Values that are not options of ours are
    skipped, so `["--temp", "0.7"]` yields nothing.
    """
    found: dict[str, str] = {}
    names = {**{n: "cache_type_k" for n in _CACHE_K}, **{n: "cache_type_v" for n in _CACHE_V},
             **{n: "flash_attn" for n in _FLASH}, **{n: "ctx" for n in _CTX},
             **{n: "parallel" for n in _PARALLEL}, **{n: "ubatch" for n in _UBATCH}}
    i = 0
    while i < len(args):
        arg = args[i]
        opt, eq, inline = arg.partition("=") if arg.startswith("-") else (arg, "", "")
        key = names.get(opt)
        i += 1
        if key is None:
            continue
        value: str | None = inline if eq else None
        if value is None and i < len(args) and (key != "flash_attn"
                                                or args[i].lower() in _FLASH_VALUES):
            value, i = args[i], i + 1
        if key == "flash_attn":
            found[key] = _FLASH_VALUES.get((value or "on").lower(), "auto")
        elif value is not None:
            found[key] = value.lower() if key.startswith("cache_type") else value
    return found


def memory_options(spec: LlamaCppModel, settings: Settings) -> LlamaMemoryOptions:
    """The options the child's command line sets: the fields (default argv) or the custom argv,
    then `extra_args`, read in that order as llama-server does."""
    ctx = spec.ctx_size or settings.default_ctx_size
    slots = settings.llama_server_parallel
    total = ctx * slots  # the default argv's `--ctx-size $ctx_total --parallel $parallel`
    head = field_args(spec)
    if spec.argv is not None:
        values = {"$ctx_total": str(total), "$parallel": str(slots), "$ctx": str(ctx)}
        head = [_substitute(a, values) for a in spec.argv]
    found = parse_args(head + list(spec.extra_args))
    # A -c there sets the total of all slots' cells; a -np how many slots share it.
    total = _int(found.get("ctx")) or total
    slots = _int(found.get("parallel")) or slots
    return LlamaMemoryOptions(
        cache_type_k=found.get("cache_type_k", "f16"),
        cache_type_v=found.get("cache_type_v", "f16"),
        flash_attn=found.get("flash_attn", "auto"),
        ctx_per_slot=max(1, total // slots),
        slots=slots,
        ubatch=_int(found.get("ubatch")) or DEFAULT_UBATCH,
    )


def _substitute(arg: str, values: dict[str, str]) -> str:
    for name, value in values.items():  # $ctx_total before its prefix $ctx
        arg = arg.replace(name, value)
    return arg
