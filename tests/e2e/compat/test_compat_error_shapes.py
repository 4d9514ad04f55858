"""Issue 32, item 8: the official `openai` SDK, with its default retries, against the demo
server where no image or audio service is configured: every answer is a 4xx with a code in
OpenAI's envelope, and what can never succeed is sent once."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from tests.e2e.compat.table import covers
from tests.support import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

WAV = b"RIFF\x24\x00\x00\x00WAVEfmt "  # enough of a file for the upload: nothing reads it


@pytest.fixture
def sent() -> list[str]:
    return []


@pytest.fixture
def client(compat_server: Server, sent: list[str]) -> Iterator[openai.OpenAI]:
    """The SDK with its default retries (2), counting what it sends with its own client."""
    hooks: dict[str, Any] = {"request": [lambda r: sent.append(r.url.path)]}
    http = httpx.Client(event_hooks=hooks, timeout=120)
    with openai.OpenAI(base_url=compat_server.url + "/v1", api_key="unused",
                       http_client=http) as c:
        yield c


@covers("Errors in the API's own shape", "OpenAI")
def test_image_and_audio_routes_nothing_serves(client: openai.OpenAI, sent: list[str]) -> None:
    with pytest.raises(openai.NotFoundError) as image:
        client.images.generate(model="dall-e-3", prompt="a red fox")
    assert image.value.code == "model_not_found" and "dall-e-3" in image.value.message
    with pytest.raises(openai.NotFoundError) as default:
        client.images.generate(prompt="a red fox")
    assert default.value.code == "model_not_found"
    assert "no model or service serves /v1/images/generations" in default.value.message
    with pytest.raises(openai.NotFoundError) as speech:
        client.audio.speech.create(model="tts-1", voice="alloy", input="hello")
    assert speech.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as heard:
        client.audio.transcriptions.create(model="whisper-1", file=("a.wav", WAV))
    assert heard.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as translated, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the SDK's, on translations
        client.audio.translations.create(model="whisper-1", file=("a.wav", WAV))
    assert translated.value.code == "not_found"
    with pytest.raises(openai.BadRequestError) as chat_model:
        client.audio.speech.create(model="smollm2", voice="alloy", input="hello")
    assert chat_model.value.code == "model_wrong_kind"
    assert sent == [*["/v1/images/generations"] * 2, "/v1/audio/speech",
                    "/v1/audio/transcriptions", "/v1/audio/translations",
                    "/v1/audio/speech"]  # each once


AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
FILE = {"type": "file", "file": {"filename": "notes.pdf",
                                 "file_data": "data:application/pdf;base64,JVBERi0="}}


@covers("Errors in the API's own shape", "OpenAI")
@pytest.mark.parametrize("part", [AUDIO, FILE], ids=["input_audio", "file"])
def test_an_audio_or_file_part_is_a_400_sent_once(client: openai.OpenAI, sent: list[str],
                                                  part: dict[str, Any]) -> None:
    messages: Any = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                  part]}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4)
    assert refused.value.status_code == 400
    assert refused.value.code == "content_type_unsupported"
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["param"] == "messages.0.content.1"
    assert sent == ["/v1/chat/completions"]  # a 500 was retried twice
