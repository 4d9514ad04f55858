"""Whether a registry entry can read images (OpenAI `image_url` parts, Ollama `images`).

llama-server answers an image sent to a model loaded without its projector with a 500 ("image
input is not supported"), which clients retry; the transformers backend would drop the image
and answer as if it had seen none. So a chat carrying images for a model that cannot read them is
refused here, a 400 `vision_unsupported`, before a lease is taken (nothing loads for it).
Which models can is decided in store/vision.py (`reads_images`, also the registry's
`Entry.vision`): llama.cpp with a projector, image-text-to-text transformers repos, OpenAI servers.
"""

from __future__ import annotations

from typing import Any

from modelyard.errors import InvalidRequest, VisionUnsupported
from modelyard.front.chat.shapes import has_images
from modelyard.store.vision import reads_images


def supports_vision(spec: Any) -> bool:
    """Whether the model `spec` (a config ModelSpec) can answer a chat that carries images."""
    return reads_images(spec)


def check_vision_for(state: Any, model: str, data: dict[str, Any]) -> None:
    """Raise VisionUnsupported when the OpenAI-shaped chat `data` carries images for a model that
    cannot read them; a name the registry cannot resolve is left to the relay, which answers
    model_not_found (or pulls it) as usual."""
    if not has_images(data.get("messages")):
        return
    try:
        entry = state.catalog.registry.resolve(model)
    except Exception:  # unresolvable names are the relay's to report
        return
    if not supports_vision(entry.spec):
        raise VisionUnsupported.for_model(entry.name)
    if entry.spec.backend in _INLINE_ONLY:
        _check_inline(data["messages"])


# Backends that run beside the GPUs, often inside a private network: an image URL a client names
# is never fetched for them (llama-server would fetch it, the transformers engine refuses it), so
# no client can make them reach inside it (SSRF). An OpenAI server decides for itself.
_INLINE_ONLY = ("llamacpp", "transformers")


def _check_inline(messages: list[Any]) -> None:
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for k, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if isinstance(url, str) and not url.startswith("data:"):
                param = f"messages.{i}.content.{k}.image_url.url"
                raise InvalidRequest(f"{param}: image URLs are not fetched; send the image inline "
                                     "as a base64 data URL (data:image/png;base64,...)",
                                     param=param)
