"""Loading a Hugging Face repo (or a GGUF file through transformers' GGUF loader) for generation.

Runs in a worker thread of the engine: `from_pretrained` takes seconds to minutes and must not
stall the engine's event loop (leases, health, other models).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelyard.config import TransformersModel
from modelyard.engine.backends.transformers.precision import Precision, choose_precision
from modelyard.engine.backends.transformers.tool_calls import template_message

log = logging.getLogger("modelyard.engine.transformers")


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    precision: Precision
    device: str


def weights_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def decide_precision(spec: TransformersModel) -> Precision:
    """Cheap (no weights read): raises InvalidRequest for a quantization that cannot run here."""
    import torch

    cuda = torch.cuda.is_available()
    source = spec.path / spec.gguf_file if spec.gguf_file else spec.path
    return choose_precision(
        spec.quantize,
        cuda=cuda,
        bf16_supported=bool(cuda and torch.cuda.is_bf16_supported()),
        bitsandbytes=importlib.util.find_spec("bitsandbytes") is not None,
        weights_bytes=weights_bytes(source),
        q4_threshold_bytes=spec.q4_threshold_bytes,
    )


def load_causal_lm(
    spec: TransformersModel, precision: Precision, placed: dict[str, Any] | None = None
) -> Loaded:
    """`placed`: the engine's placement as `from_pretrained` keywords (device_map.py); a user's
    own `device_map` in the spec wins over it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec.trust_remote_code:
        log.warning("%s: trust_remote_code is on: running the repo's own Python code", spec.id)
    dtype = getattr(torch, precision.dtype)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": spec.trust_remote_code}
    if precision.load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(  # type: ignore[no-untyped-call]
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
        )
    cuda = torch.cuda.is_available()
    if spec.device_map is not None:
        kwargs["device_map"] = spec.device_map
        if spec.max_memory:
            kwargs["max_memory"] = spec.max_memory
        if spec.offload_folder:
            kwargs["offload_folder"] = str(spec.offload_folder)
    elif cuda and placed:
        kwargs.update(placed)
    elif cuda:
        kwargs["device_map"] = {"": 0}  # the engine's one GPU (CUDA_VISIBLE_DEVICES)
    tok_kwargs: dict[str, Any] = {"trust_remote_code": spec.trust_remote_code}
    if spec.gguf_file:
        kwargs["gguf_file"] = tok_kwargs["gguf_file"] = spec.gguf_file
    log.info("loading %s from %s (%s)", spec.id, spec.path, precision.why)
    model = AutoModelForCausalLM.from_pretrained(str(spec.path), **kwargs)
    model.eval()  # type: ignore[no-untyped-call]
    tokenizer = AutoTokenizer.from_pretrained(str(spec.path), **tok_kwargs)
    device = str(next(model.parameters()).device)
    return Loaded(model, tokenizer, precision, device)


def _text(content: Any) -> str:
    """OpenAI message content: a string, or parts of which the text ones count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and p.get("type") == "text")
    raise ValueError("message content must be a string or a list of parts")


def chat_prompt_ids(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """The model's own chat template over the request's messages (tools included)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("`messages` must be a non-empty list")
    plain = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError("each message needs a `role`")
        plain.append(template_message({**m, "content": _text(m.get("content"))}))
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model has no chat template: use /v1/completions with a prompt")
    ids = tokenizer.apply_chat_template(
        plain, tools=None if body.get("tool_choice") == "none" else body.get("tools") or None,
        add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def completion_prompt_ids(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return [int(t) for t in prompt]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ValueError("`prompt` must be a string (or token ids)")
    return [int(i) for i in tokenizer(prompt)["input_ids"]]
