"""Image-text-to-text models in the transformers engine (engine/backends/transformers/vision.py),
on a tiny random Llava the test builds: the image reaches the model (its tokens are in the prompt,
different images give different logits), sampling follows the request, bad images are 400s, and
URLs are never fetched."""

from __future__ import annotations

import base64
import math
import struct
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.unit.transformers.tiny_vlm import IMAGE_TOKENS, build_tiny_vlm, data_url, png_base64

from modelyard.config import LlamaCppModel, TransformersModel
from modelyard.engine.backends.transformers.generator import TokenEvent
from modelyard.engine.backends.transformers.params import SamplingParams
from modelyard.engine.backends.transformers.precision import Precision
from modelyard.engine.backends.transformers.vision import (
    MAX_IMAGE_PIXELS,
    LoadedVision,
    VisionGenerator,
    load_image_text,
    vision_chat_prompt,
)
from modelyard.store.vision import is_image_text_repo, reads_images

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]

RED, BLUE = (255, 0, 0), (0, 0, 255)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="module")
def loaded(repo: Path) -> Iterator[LoadedVision]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add synchronisation
    spec = TransformersModel(id="tiny-vlm", path=repo)
    yield load_image_text(spec, Precision(load_in_4bit=False, dtype="float32", why="test"))
    torch.set_num_threads(threads)


def chat(*content: Any, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(content)}], **extra}


def image(color: tuple[int, int, int]) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(color)}}


TEXT = {"type": "text", "text": "What colour is this?"}


async def collect(events: AsyncIterator[TokenEvent]) -> tuple[list[int], TokenEvent, list[Any]]:
    ids: list[int] = []
    logprobs: list[Any] = []
    last = None
    async for event in events:
        ids += event.token_ids
        logprobs += event.logprobs or []
        last = event
    assert last is not None
    return ids, last, logprobs


def test_a_repo_with_a_vision_tower_and_a_processor_reads_images(repo: Path,
                                                                 tmp_path: Path) -> None:
    assert is_image_text_repo(repo)
    assert reads_images(TransformersModel(id="v", path=repo))
    assert not reads_images(TransformersModel(id="v", path=repo, vision=False))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert not reads_images(TransformersModel(id="t", path=tmp_path))
    gguf = tmp_path / "m.gguf"
    assert not reads_images(LlamaCppModel(id="g", path=gguf))
    assert reads_images(LlamaCppModel(id="g", path=gguf, mmproj=tmp_path / "mmproj-f16.gguf"))


def test_the_image_becomes_the_processors_image_tokens(loaded: LoadedVision) -> None:
    with_image = vision_chat_prompt(loaded.processor, chat(image(RED), TEXT))
    without = vision_chat_prompt(loaded.processor, chat(TEXT))
    image_id = loaded.model.config.image_token_index
    assert with_image.count(image_id) == IMAGE_TOKENS
    assert image_id not in without
    assert "pixel_values" in with_image.inputs and "pixel_values" not in without.inputs


async def test_different_images_give_different_logits(loaded: LoadedVision) -> None:
    gen = VisionGenerator(loaded.model, loaded.tokenizer)
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=5)
    answers = []
    for color in (RED, BLUE, RED):
        prompt = vision_chat_prompt(loaded.processor, chat(image(color), TEXT))
        ids, last, logprobs = await collect(gen.generate(prompt, params))
        assert last.usage is not None
        assert last.usage["prompt_tokens"] == len(prompt)
        answers.append((ids, [entry["logprob"] for entry in logprobs[0]["top_logprobs"]]))
    (red, red_top), (_, blue_top), (red_again, red_top_again) = answers
    assert red == red_again and red_top == pytest.approx(red_top_again)  # greedy: reproducible
    assert red_top != pytest.approx(blue_top)  # the pixels reached the language model


async def test_greedy_output_is_the_models_own_generate(loaded: LoadedVision) -> None:
    import torch

    gen = VisionGenerator(loaded.model, loaded.tokenizer)
    prompt = vision_chat_prompt(loaded.processor, chat(image(BLUE), TEXT))
    ids, last, _ = await collect(gen.generate(prompt, SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True)))
    with torch.inference_mode():
        out = loaded.model.generate(**prompt.inputs, max_new_tokens=6, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
    assert ids == out[0, len(prompt):].tolist()
    assert last.finish_reason == "length"


async def test_a_seed_makes_sampling_reproducible(loaded: LoadedVision) -> None:
    gen = VisionGenerator(loaded.model, loaded.tokenizer)
    prompt = vision_chat_prompt(loaded.processor, chat(image(RED), TEXT))
    runs = [await collect(gen.generate(prompt, SamplingParams(
        max_tokens=8, temperature=1.5, seed=seed, ignore_eos=True))) for seed in (7, 7, 8)]
    assert runs[0][0] == runs[1][0]
    assert len(runs[0][0]) == 8
    assert runs[0][0] != runs[2][0]


async def test_closing_the_stream_frees_the_model_for_the_next(loaded: LoadedVision) -> None:
    gen = VisionGenerator(loaded.model, loaded.tokenizer)
    prompt = vision_chat_prompt(loaded.processor, chat(image(RED), TEXT))
    stream = gen.generate(prompt, SamplingParams(max_tokens=400, ignore_eos=True))
    first = await anext(aiter(stream))
    assert first.finish_reason is None
    await stream.aclose()  # type: ignore[attr-defined]
    ids, last, _ = await collect(gen.generate(prompt, SamplingParams(max_tokens=2)))
    assert last.finish_reason in ("length", "stop") and 1 <= len(ids) <= 2
    assert gen.stats()["started"] == 2


@pytest.mark.parametrize(("url", "problem"), [
    ("https://example.com/cat.png", "not fetched"),
    ("http://169.254.169.254/latest/meta-data", "not fetched"),
    ("file:///etc/passwd", "data URL"),
    ("data:image/png;base64,!!!", "base64"),
    ("data:image/png;base64," + "aGVsbG8=", "cannot be decoded"),
])
def test_bad_or_remote_images_are_refused(loaded: LoadedVision, url: str, problem: str) -> None:
    body = chat({"type": "image_url", "image_url": {"url": url}}, TEXT)
    with pytest.raises(ValueError, match=problem):
        vision_chat_prompt(loaded.processor, body)


def test_a_decompression_bomb_is_refused_before_it_decodes(loaded: LoadedVision) -> None:
    # A real 1x1 PNG whose header claims a huge size: only the header may be read.
    side = math.isqrt(MAX_IMAGE_PIXELS) + 1
    png = bytearray(base64.b64decode(png_base64((0, 0, 0), (1, 1))))
    png[16:24] = struct.pack(">II", side, side)  # IHDR width, height
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))  # IHDR's CRC
    body = chat({"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(bytes(png)).decode()}})
    with pytest.raises(ValueError, match="pixels"):
        vision_chat_prompt(loaded.processor, body)
