"""What a chat carries besides text -- content parts, images, tools -- is checked before it is
relayed (front/chat/shapes.py), and images only go to a model that reads them
(front/chat/vision.py): a client's mistake is a 400 naming the field, not the backend's 500."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from modelyard.config import LlamaCppModel, OpenAIServerModel, ServiceModel, TransformersModel
from modelyard.errors import InvalidRequest
from modelyard.front.chat.shapes import (
    check_ollama_chat,
    check_ollama_images,
    check_openai_chat,
    has_images,
)
from modelyard.front.chat.vision import supports_vision

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAAAAAA6fptVAAAACklEQVR4nGNgAAAAAgABSK+kcQAAAABJRU5ErkJggg=="
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def chat(*parts: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}], **fields}


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def param_of(check: Any, data: Any) -> str | None:
    with pytest.raises(InvalidRequest) as caught:
        check(data)
    assert caught.value.status == 400 and caught.value.code == "invalid_request"
    assert caught.value.param is not None and caught.value.param in caught.value.message
    return caught.value.param


def test_well_formed_chats_pass() -> None:
    check_openai_chat(chat({"type": "text", "text": "hi"}, image(f"data:image/png;base64,{PNG}"),
                           image("https://example.org/cat.png"), {"type": "input_audio"},
                           tools=[WEATHER, {"type": "mcp", "server": "time"}],
                           tool_choice="auto"))
    check_openai_chat({"messages": [{"role": "user", "content": "hi"}], "tools": [],
                       "tool_choice": {"type": "function", "function": {"name": "weather"}}})
    check_openai_chat({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "w", "arguments": "{}"}}]}]})
    check_ollama_chat({"messages": [{"role": "user", "content": "x", "images": [PNG]}],
                       "tools": [WEATHER]})


@pytest.mark.parametrize(("data", "param"), [
    (chat(image("data:image/png;base64,")), "messages.0.content.0.image_url.url"),
    (chat(image("data:image/png;base64,!!!!")), "messages.0.content.0.image_url.url"),
    (chat(image("data:image/png;base64,abc")), "messages.0.content.0.image_url.url"),
    (chat(image(f"data:image/png,{PNG}")), "messages.0.content.0.image_url.url"),
    (chat(image("")), "messages.0.content.0.image_url.url"),
    (chat({"type": "image_url", "image_url": "https://x/y.png"}),
     "messages.0.content.0.image_url"),
    (chat({"type": "text", "text": 3}), "messages.0.content.0.text"),
    (chat("just a string"), "messages.0.content.0"),
    (chat({"text": "no type"}), "messages.0.content.0"),
    (chat(tools="x"), "tools"),
    (chat(tools={"type": "function"}), "tools"),
    (chat(tools=["weather"]), "tools.0"),
    (chat(tools=[{"function": {"name": "w"}}]), "tools.0"),
    (chat(tools=[{"type": "function"}]), "tools.0.function"),
    (chat(tools=[{"type": "function", "function": {"name": ""}}]), "tools.0.function"),
    (chat(tools=[{"type": "function", "function": {"name": "w", "parameters": "{}"}}]),
     "tools.0.function.parameters"),
    (chat(tool_choice="maybe"), "tool_choice"),
    (chat(tool_choice={"type": "function"}), "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": "w()"}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": ["w()"]}]}, "messages.0.tool_calls.0"),
])
def test_malformed_openai_chats_name_the_field(data: dict[str, Any], param: str) -> None:
    assert param_of(check_openai_chat, data) == param


@pytest.mark.parametrize(("data", "param"), [
    ({"messages": [{"role": "user", "images": [""]}]}, "messages.0.images.0"),
    ({"messages": [{"role": "user", "images": ["not base64!"]}]}, "messages.0.images.0"),
    # Non-ASCII text: binascii raises a plain ValueError, not binascii.Error (found by make fuzz)
    ({"messages": [{"role": "user", "images": ["\u0089\u00b9"]}]}, "messages.0.images.0"),
    ({"messages": [{"role": "user", "images": [PNG, 7]}]}, "messages.0.images.1"),
    ({"messages": [{"role": "user", "images": PNG}]}, "messages.0.images"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": "w"}]}]},
     "messages.0.tool_calls.0"),
    ({"messages": [], "tools": "x"}, "tools"),
])
def test_malformed_ollama_chats_name_the_field(data: dict[str, Any], param: str) -> None:
    assert param_of(check_ollama_chat, data) == param


def test_ollama_generate_images() -> None:
    check_ollama_images([PNG], "images")
    check_ollama_images(None, "images")
    assert param_of(lambda d: check_ollama_images(d, "images"), [""]) == "images.0"


def test_has_images() -> None:
    assert has_images(chat(image("https://x/y.png"))["messages"])
    assert not has_images(chat({"type": "text", "text": "hi"})["messages"])
    assert not has_images([{"role": "user", "content": "an image_url"}])
    assert not has_images("nonsense")


def test_vision_capability_rule(tmp_path: Path) -> None:
    gguf, proj = tmp_path / "m.gguf", tmp_path / "mmproj-m.gguf"
    assert not supports_vision(LlamaCppModel(id="a", path=gguf))
    assert supports_vision(LlamaCppModel(id="a", path=gguf, mmproj=proj))
    # Its own argv: only what it passes counts.
    assert not supports_vision(LlamaCppModel(id="a", path=gguf, mmproj=proj, argv=["x", "$path"]))
    assert supports_vision(LlamaCppModel(id="a", path=gguf, argv=["x", "--mmproj", "/p.gguf"]))
    assert supports_vision(LlamaCppModel(id="a", path=gguf, extra_args=["-mm", "/p.gguf"]))
    assert not supports_vision(LlamaCppModel(id="a", path=gguf, mmproj=proj, vision=False))
    assert supports_vision(OpenAIServerModel(id="o", argv=["x"]))
    assert not supports_vision(OpenAIServerModel(id="o", argv=["x"], vision=False))
    assert not supports_vision(TransformersModel(id="t", path=tmp_path))
    assert not supports_vision(ServiceModel(id="s", url="http://127.0.0.1:1"))
    assert supports_vision(ServiceModel(id="s", url="http://127.0.0.1:1", vision=True))


def test_an_image_text_to_text_repo_reads_images(tmp_path: Path) -> None:
    """A transformers repo with a vision tower and a processor (Llava, SmolVLM, Qwen2-VL...)
    reads images; the registry entry says so for /api/show."""
    from modelyard.store.registry import Entry

    (tmp_path / "config.json").write_text('{"model_type": "llava", "vision_config": {}}')
    assert not supports_vision(TransformersModel(id="t", path=tmp_path))  # no processor
    (tmp_path / "processor_config.json").write_text("{}")
    spec = TransformersModel(id="t", path=tmp_path)
    assert supports_vision(spec) and Entry(spec, "config").vision
    assert not Entry(TransformersModel(id="t", path=tmp_path, vision=False), "config").vision
    # Through transformers' GGUF loader there is no processor: text only.
    assert not supports_vision(TransformersModel(id="t", path=tmp_path, gguf_file="m.gguf"))


def test_image_urls_are_never_fetched_for_local_backends(tmp_path: Path) -> None:
    """llama-server would fetch an http(s) image URL from inside the network it runs in: the
    front refuses it (400) for llama.cpp and transformers models; data URLs pass; an OpenAI
    server decides for itself."""
    from types import SimpleNamespace

    from modelyard.errors import InvalidRequest
    from modelyard.front.chat.vision import check_vision_for
    from modelyard.store.registry import Entry, ModelRegistry

    gguf, proj = tmp_path / "m.gguf", tmp_path / "mmproj-m.gguf"
    registry = ModelRegistry([
        Entry(LlamaCppModel(id="llava", path=gguf, mmproj=proj), "config"),
        Entry(OpenAIServerModel(id="remote", argv=["x"]), "config")])
    state = SimpleNamespace(catalog=SimpleNamespace(registry=registry))
    inline = chat(image("data:image/png;base64,iVBORw0KGgo="))
    check_vision_for(state, "llava", inline)
    for url in ("http://169.254.169.254/latest/meta-data", "https://example.com/a.png",
                "file:///etc/passwd"):
        with pytest.raises(InvalidRequest, match="not fetched") as refused:
            check_vision_for(state, "llava", chat(image(url)))
        assert refused.value.status == 400
    check_vision_for(state, "remote", chat(image("https://example.com/a.png")))
