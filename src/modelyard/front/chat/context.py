"""Ollama's `options.num_ctx`: a request served by an instance with at least that context.

Decision: a larger context is another instance, not a reload. The request is leased on the
context variant `<model>@ctx<N>` (store/registry.py), a model of its own to the engine: its own
llama-server (`--ctx-size` N x slots; the transformers engine's max context), its own memory
estimate (the KV cache grows with N), scheduled, evicted and kept alive like any model. So the
requests in flight on the default instance are never cut short, and the scheduler decides, by
memory and priority, whether both fit or one must go, exactly as for two models.

A request whose `num_ctx` the model's own context already covers uses the model as it is (an
instance with at least that context); N is rounded up to a multiple of CTX_STEP so that nearby
values share one instance.
"""

from __future__ import annotations

from typing import Any

from modelyard.config import LlamaCppModel
from modelyard.errors import InvalidRequest
from modelyard.store.registry import context_variant_name

CTX_STEP = 256  # tokens


def context_size(spec: Any, default_ctx_size: int) -> int | None:
    """The context a model is served with; None: its own (unknown here, taken as enough)."""
    ctx = getattr(spec, "ctx_size", None)
    if isinstance(ctx, int):
        return ctx
    return default_ctx_size if isinstance(spec, LlamaCppModel) else None


def check_num_ctx(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidRequest(f"options.num_ctx: {value!r} is not a positive integer",
                             param="options.num_ctx")
    return value


def serve_as(state: Any, model: str, num_ctx: Any) -> str | None:
    """The name to lease for a request that asks `num_ctx` of `model`: its context variant when
    the model's context is smaller, else None (the model as it is). An unresolvable name is
    left to the relay (model_not_found)."""
    wanted = check_num_ctx(num_ctx)
    if wanted is None:
        return None
    try:
        entry = state.catalog.registry.resolve(model)
    except Exception:  # unresolvable names are the relay's to report
        return None
    if not hasattr(entry.spec, "ctx_size"):
        return None  # a service: its context is not ours to set
    current = context_size(entry.spec, state.catalog.settings.default_ctx_size)
    if current is None or wanted <= current:
        return None
    return context_variant_name(model, -(-wanted // CTX_STEP) * CTX_STEP)
