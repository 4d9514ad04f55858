"""Ollama's `options.num_ctx`: a request served by an instance with at least that context.

Decision: a larger context is another instance, not a reload. The request is leased on the
context variant `<model>@ctx<N>` (store/registry.py), a model of its own to the engine: its own
llama-server (`--ctx-size` N x slots; the transformers engine's max context), its own memory
estimate (the KV cache grows with N), scheduled, evicted and kept alive like any model. So the
requests in flight on the default instance are never cut short, and the scheduler decides, by
memory and priority, whether both fit or one must go, exactly as for two models.

A request whose `num_ctx` the model's own context already covers uses the model as it is. A
larger one is a server any caller could start, so it is rationed (docs/scheduling.md):
- a `num_ctx` over the model's trained context (its GGUF's `<arch>.context_length`), or over
  CTX_BOUND when the file does not say, is impossible: 400 num_ctx_too_large;
- over the caller's `max_num_ctx` limit (front/identity/limits.py; admins have none): 403;
- N is `num_ctx` rounded up to a power of two (at most the trained context), so that nearby
  values share one instance and a model has only a handful of sizes at all;
- a running variant that fits (the smallest) serves the request rather than a new one;
- at most `max_context_variants` variants of a model run at once: past that, 429
  context_variants_full naming the sizes that run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from modelyard.config import LlamaCppModel
from modelyard.errors import ContextVariantsFull, InvalidRequest, NumCtxNotAllowed, NumCtxTooLarge
from modelyard.store.gguf import cached_gguf_info
from modelyard.store.registry import context_variant_name, split_context_variant

# The most tokens a model whose file does not say its trained context may be asked for: 2^20,
# above every open model's trained context but Llama 4 Scout's 10M (whose GGUF says so). A
# sanity bound, not a memory one: whether N fits is the scheduler's call.
CTX_BOUND = 1 << 20


def context_size(spec: Any, default_ctx_size: int) -> int | None:
    """The context a model is served with; None: its own (unknown here, taken as enough)."""
    ctx = getattr(spec, "ctx_size", None)
    if isinstance(ctx, int):
        return ctx
    return default_ctx_size if isinstance(spec, LlamaCppModel) else None


def check_num_ctx(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 8192.0: what a JSON encoder may make of 8192
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidRequest(f"options.num_ctx: {value!r} is not a positive integer",
                             param="options.num_ctx")
    return value


def max_context(entry: Any) -> int:
    """The largest context `entry`'s model may be served with: what it was trained for, else
    CTX_BOUND."""
    return max_context_of(entry.path if entry.format == "gguf" else None)


def max_context_of(gguf: Path | None) -> int:
    """The trained context a GGUF file says (`<arch>.context_length`), else CTX_BOUND."""
    info = None if gguf is None else cached_gguf_info(gguf)
    trained = None if info is None else info.context_length
    return trained if trained else CTX_BOUND


def check_fits(model: str, most: int, num_ctx: int, *, param: str = "options.num_ctx") -> None:
    """NumCtxTooLarge when `num_ctx` is over `most` (max_context): no server of `model`
    could honour it."""
    if num_ctx > most:
        said = ("was trained for" if most != CTX_BOUND
                else "may be asked for (its file does not say its trained context)")
        raise NumCtxTooLarge(
            f"{param}: {num_ctx} is more than the {most} tokens model '{model}' {said}",
            param=param, model=model)


def variant_size(num_ctx: int, most: int) -> int:
    """`num_ctx` rounded up to a power of two, at most `most`."""
    return min(1 << (num_ctx - 1).bit_length(), most)


async def serve_as(state: Any, model: str, num_ctx: Any, *,
                   allowed: int | None = None) -> str | None:
    """The name to lease for a request that asks `num_ctx` of `model`: a context variant when
    the model's context is smaller, else None (the model as it is). `allowed`: the caller's
    `max_num_ctx` (None: no limit of its own). An unresolvable name is left to the relay
    (model_not_found)."""
    wanted = check_num_ctx(num_ctx)
    if wanted is None:
        return None
    try:
        entry = state.catalog.registry.resolve(model)
    except Exception:  # unresolvable names are the relay's to report
        return None
    if not hasattr(entry.spec, "ctx_size"):
        return None  # a service: its context is not ours to set
    settings = state.catalog.settings
    current = context_size(entry.spec, settings.default_ctx_size)
    if current is None or wanted <= current:
        return None
    most = max_context(entry)
    check_fits(model, most, wanted)
    if allowed is not None and wanted > allowed:
        raise NumCtxNotAllowed(
            f"options.num_ctx: {wanted} is over the context model '{model}' is served with "
            f"({current}) and over your max_num_ctx limit ({allowed}): a larger context starts "
            f"a server of its own; ask for at most {max(current, allowed)}, or ask an admin",
            param="options.num_ctx", model=model)
    size = variant_size(wanted, most)
    running = await running_variants(state, entry.id)
    fitting = [n for n in running if n >= wanted]
    if size not in running and fitting:
        size = min(fitting)  # a server that runs already: no new one
    elif size not in running and len(running) >= settings.max_context_variants:
        sizes = ", ".join(str(n) for n in running) or "none may run"
        raise ContextVariantsFull(
            f"options.num_ctx: model '{model}' runs its max_context_variants "
            f"({settings.max_context_variants}) larger contexts ({sizes}), none of "
            f"{wanted} tokens; ask for at most {max(running, default=current)}, or retry when "
            "one unloads", param="options.num_ctx", model=model)
    return context_variant_name(model, size)


async def running_variants(state: Any, model_id: str) -> list[int]:
    """The contexts of `model_id`'s variants loaded or loading on the engines, ascending."""
    sizes = set()
    for name in await state.dispatch.loaded_models():
        parsed = split_context_variant(name)
        if parsed is not None and parsed[0] == model_id:
            sizes.add(parsed[1])
    return sorted(sizes)
