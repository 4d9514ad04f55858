"""Which models read images, decided from the spec and the files (no weights read, no torch).

Order, as for tools: the model's explicit `vision` setting wins; llama.cpp reads images when it is
given a projector (`mmproj`, found beside the GGUF by the catalog or declared, or `--mmproj` in
its own argv); a transformers repo does when it is an image-text-to-text model (its config.json
has a `vision_config` and the repo ships a processor: what `AutoProcessor` +
`AutoModelForImageTextToText` load); any OpenAI server may (the server decides); services do not.

The registry's `Entry.vision` and `/api/show`'s `vision` capability read `reads_images`, and the
front refuses images for a model that cannot read them (front/chat/vision.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from modelyard.config import LlamaCppModel, OpenAIServerModel, TransformersModel

_PROJECTOR_FLAGS = ("--mmproj", "-mm", "--mmproj-url", "-mmu")
# What a processor's files are called (transformers 4.x wrote preprocessor_config.json).
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def is_image_text_repo(path: Path | None) -> bool:
    """A Hugging Face repo directory of an image-text-to-text model (Llava, Idefics3/SmolVLM,
    Qwen2-VL, Gemma 3...): a vision tower in its config and an image processor beside it."""
    if path is None or not path.is_dir():
        return False
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict) or not isinstance(config.get("vision_config"), dict):
        return False
    return any((path / name).is_file() for name in _PROCESSOR_FILES)


def reads_images(spec: Any) -> bool:
    """Whether the model `spec` (a config ModelSpec) can answer a chat that carries images."""
    explicit = getattr(spec, "vision", None)
    if explicit is not None:
        return bool(explicit)
    if isinstance(spec, LlamaCppModel):
        args = [*(spec.argv or []), *spec.extra_args]
        if any(a in _PROJECTOR_FLAGS for a in args):
            return True
        return spec.mmproj is not None and spec.argv is None  # the default argv passes it
    if isinstance(spec, TransformersModel):
        # A GGUF through transformers' loader has no processor; vLLM serves the same repos.
        return spec.gguf_file is None and is_image_text_repo(spec.path)
    return isinstance(spec, OpenAIServerModel)
