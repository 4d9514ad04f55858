"""Whether a registry entry can read images (OpenAI `image_url` parts, Ollama `images`), audio
and video (`input_audio`, `input_video`, `video_url` parts) and files (`file` parts).

llama-server answers an image sent to a model loaded without its projector with a 500 ("image
input is not supported"), which clients retry; the transformers backend would drop the image
and answer as if it had seen none. So a chat carrying images for a model that cannot read them is
refused here, a 400 `vision_unsupported`, before a lease is taken (nothing loads for it).
Which models can is decided in store/vision.py (`reads_images`, also the registry's
`Entry.vision`): llama.cpp with a projector, image-text-to-text transformers repos, OpenAI servers.

Audio, video and file parts are alike: llama-server answers audio and video with a 500 (the
OpenAI SDK retries it twice) and a `file` part with a 400 in its own shape, and the transformers
engine reads none. Only an OpenAI server may read them (it decides: vLLM serves audio models);
modelyard loads a llama.cpp projector for images, so for every other model they are a 400
`content_type_unsupported` naming the part and the model, before a lease is taken.
"""

from __future__ import annotations

from typing import Any

from modelyard.config import OpenAIServerModel
from modelyard.errors import ContentTypeUnsupported, InvalidRequest, VisionUnsupported
from modelyard.store.vision import reads_images

# Content parts only an OpenAI server may read, and what each carries.
_SERVER_ONLY_PARTS = {"input_audio": "audio", "input_video": "video", "video_url": "video",
                      "file": "files"}


def supports_vision(spec: Any) -> bool:
    """Whether the model `spec` (a config ModelSpec) can answer a chat that carries images."""
    return reads_images(spec)


def check_vision_for(state: Any, model: str, data: dict[str, Any]) -> None:
    """Raise VisionUnsupported when the OpenAI-shaped chat `data` carries images for a model that
    cannot read them, ContentTypeUnsupported for an audio, video or file part; a name the registry
    cannot resolve is left to the relay, which answers model_not_found (or pulls it) as usual."""
    images, other = _media(data.get("messages"))
    if not images and other is None:
        return
    try:
        entry = state.catalog.registry.resolve(model)
    except Exception:  # unresolvable names are the relay's to report
        return
    if other is not None and not isinstance(entry.spec, OpenAIServerModel):
        param, kind = other
        raise ContentTypeUnsupported(
            f"{param}: model '{entry.name}' cannot read {_SERVER_ONLY_PARTS[kind]} (a `{kind}` "
            "part); send the content as text", param=param, model=entry.name)
    if not images:
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


def _media(messages: Any) -> tuple[bool, tuple[str, str] | None]:
    """In one pass over OpenAI-shaped `messages`: whether they carry an image part, and the
    (param, type) of their first audio, video or file part. Text-only chats cost a loop."""
    images, other = False, None
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                images = True
            elif other is None and kind in _SERVER_ONLY_PARTS:
                other = f"messages.{i}.content.{k}", kind
    return images, other
