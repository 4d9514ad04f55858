"""Issue 32, item 8: what no model here serves is a 4xx with a code in OpenAI's envelope.

The official `openai` SDK against a real `modelyard serve` with no service configured and fake
llama-server processes that answer as llama-server does (tests/fakes/fake_backend.py): an audio
part is its 500 ("audio input is not supported"), which the SDK retried twice, and a `file` part
its own 400 shape. Here the image and audio routes are 404 `model_not_found` (`not_found` for a
route modelyard has not) and those parts a 400 `content_type_unsupported` naming the part, sent
once and refused before anything loads.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tests.integration.harness import config, module_server, starts
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

WAV = b"RIFF\x24\x00\x00\x00WAVEfmt "  # enough of a file for the upload: nothing reads it


def gguf_model(model_id: str, files: Path) -> dict[str, Any]:
    """A llama.cpp model without a projector whose argv runs the fake llama-server."""
    weights = files / f"{model_id}.gguf"
    weights.write_bytes(b"GGUF" + b"\x00" * 20)
    spec = fake_model(model_id, "--start-log", str(files / f"{model_id}.starts"))
    spec.update(backend="llamacpp", path=str(weights))
    return spec


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, files: Path) -> Iterator[Server]:
    with module_server(tmp_path_factory, config(gguf_model("text", files))) as s:
        yield s


class Sent:
    """The requests the SDK sent (its retries included), seen by its own HTTP client."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def __call__(self, request: httpx.Request) -> None:
        self.paths.append(request.url.path)


@pytest.fixture
def sent() -> Sent:
    return Sent()


@pytest.fixture
def client(server: Server, sent: Sent) -> Iterator[openai.OpenAI]:
    # The SDK's default retries (2): a 5xx would be sent three times, a 4xx once.
    http = httpx.Client(event_hooks={"request": [sent]}, timeout=30)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", http_client=http) as c:
        yield c


def test_images_nothing_serves_are_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as named:
        client.images.generate(model="dall-e-3", prompt="a red fox")
    assert named.value.code == "model_not_found" and "dall-e-3" in named.value.message
    with pytest.raises(openai.NotFoundError) as unnamed:
        client.images.generate(prompt="a red fox")  # no model: the API's default
    assert unnamed.value.code == "model_not_found"
    assert "no model or service serves /v1/images/generations" in unnamed.value.message
    body = unnamed.value.body
    assert isinstance(body, dict) and body["param"] == "model"
    assert body["type"] == "invalid_request_error"


def test_audio_nothing_serves_is_404_with_a_code(client: openai.OpenAI, sent: Sent) -> None:
    with pytest.raises(openai.NotFoundError) as speech:
        client.audio.speech.create(model="tts-1", voice="alloy", input="hello")
    assert speech.value.code == "model_not_found" and "tts-1" in speech.value.message
    with pytest.raises(openai.NotFoundError) as heard:
        client.audio.transcriptions.create(model="whisper-1", file=("a.wav", WAV))
    assert heard.value.code == "model_not_found" and "whisper-1" in heard.value.message
    with pytest.raises(openai.NotFoundError) as translated, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the SDK's, on translations
        client.audio.translations.create(model="whisper-1", file=("a.wav", WAV))
    assert translated.value.code == "not_found"  # a route modelyard has not
    assert sent.paths == ["/v1/audio/speech", "/v1/audio/transcriptions",
                          "/v1/audio/translations"]  # a 404 is not retried


def test_a_chat_model_on_an_image_route_is_400_model_wrong_kind(
    client: openai.OpenAI, files: Path
) -> None:
    with pytest.raises(openai.BadRequestError) as wrong:
        client.images.generate(model="text", prompt="a red fox")
    assert wrong.value.code == "model_wrong_kind" and "image" in wrong.value.message
    assert starts(files / "text.starts") == []


AUDIO_PART = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
FILE_PART = {"type": "file", "file": {"filename": "a.pdf",
                                      "file_data": "data:application/pdf;base64,JVBERi0="}}


@pytest.mark.parametrize("part", [AUDIO_PART, FILE_PART], ids=["input_audio", "file"])
def test_an_audio_or_file_part_is_400_content_type_unsupported_sent_once(
    client: openai.OpenAI, sent: Sent, files: Path, part: dict[str, Any]
) -> None:
    messages: Any = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                  part]}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="text", messages=messages)
    assert refused.value.status_code == 400
    assert refused.value.code == "content_type_unsupported"
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == "messages.0.content.1"
    assert part["type"] in refused.value.message and "'text'" in refused.value.message
    assert sent.paths == ["/v1/chat/completions"]  # once: no retries
    assert starts(files / "text.starts") == []  # refused before a lease: nothing loaded


def test_the_native_chat_refuses_an_audio_part_in_its_own_shape(server: Server) -> None:
    r = httpx.post(server.url + "/chat", timeout=30, json={
        "model": "text", "stream": False,
        "messages": [{"role": "user", "content": [AUDIO_PART]}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == "content_type_unsupported"
    assert r.json()["param"] == "messages.0.content.0"
