"""End to end: images reach an image-text-to-text model in the transformers engine, through the
front, with the official `openai` and `ollama` clients.

The model is a tiny random Llava the test builds (tests/unit/transformers/tiny_vlm.py): its
answers are noise, so the tests check that the image reached it — 16 more prompt tokens than the
same chat without it (the processor's 16 patch tokens for one `<image>`), and other logprobs for
another image — and that what must be refused is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ollama
import openai
import pytest
from tests.e2e.compat.table import covers
from tests.support import Server
from tests.unit.transformers.tiny_vlm import IMAGE_TOKENS, build_tiny_vlm, data_url, png_base64

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

RED, BLUE = (255, 0, 0), (0, 0, 255)
QUESTION = "What colour is this?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    repo = build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))
    config = {
        "scan_hf_cache": False,
        # Not what this module tests: on a busy 2-core machine the engine's first load (torch,
        # transformers' vision modules) once kept its loop from answering the 3 s heartbeat.
        "engine_heartbeat_timeout_s": 30,
        "models": [
            {"id": "tiny-vlm", "backend": "transformers", "path": str(repo)},
            # The same repo declared blind: images for it are the client's mistake.
            {"id": "tiny-vlm-blind", "backend": "transformers", "path": str(repo),
             "vision": False},
        ],
    }
    srv = Server(tmp_path_factory.mktemp("vision-home"), config)
    try:
        srv.wait_healthy(90)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=240,
                         max_retries=0)


def user(*images: str) -> list[Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}}
                                   for url in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


@covers("Images (vision)", "OpenAI")
def test_openai_image_parts_reach_the_model(oai: openai.OpenAI) -> None:
    def ask(messages: list[Any]) -> Any:
        return oai.chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=3,
                                           temperature=0, logprobs=True, top_logprobs=5)

    red, blue, plain = ask(user(data_url(RED))), ask(user(data_url(BLUE))), ask(user())
    assert red.usage.prompt_tokens == plain.usage.prompt_tokens + IMAGE_TOKENS
    assert blue.usage.prompt_tokens == red.usage.prompt_tokens

    def top(answer: Any) -> list[float]:
        return [t.logprob for t in answer.choices[0].logprobs.content[0].top_logprobs]

    assert top(red) != pytest.approx(top(blue))
    assert top(ask(user(data_url(RED)))) == pytest.approx(top(red))  # greedy: reproducible
    streamed = oai.chat.completions.create(model="tiny-vlm", messages=user(data_url(RED)),
                                           max_tokens=3, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == red.choices[0].message.content


@covers("Images (vision)", "Ollama")
def test_ollama_images_reach_the_model(server: Server) -> None:
    client = ollama.Client(host=server.url, timeout=240)
    options = {"temperature": 0, "num_predict": 2}
    with_image = client.chat(model="tiny-vlm", options=options, messages=[
        {"role": "user", "content": QUESTION, "images": [png_base64(RED)]}])
    without = client.chat(model="tiny-vlm", options=options,
                          messages=[{"role": "user", "content": QUESTION}])
    assert with_image["prompt_eval_count"] == without["prompt_eval_count"] + IMAGE_TOKENS
    generated = client.generate(model="tiny-vlm", prompt=QUESTION, images=[png_base64(BLUE)],
                                options=options)
    assert generated["prompt_eval_count"] == with_image["prompt_eval_count"]


def test_an_image_url_is_not_fetched_and_a_blind_model_refuses_images(
    oai: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError, match="not fetched"):
        oai.chat.completions.create(model="tiny-vlm", max_tokens=2,
                                    messages=user("http://127.0.0.1:9/secret.png"))
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model="tiny-vlm-blind", max_tokens=2,
                                    messages=user(data_url(RED)))
    assert refused.value.code == "vision_unsupported"
