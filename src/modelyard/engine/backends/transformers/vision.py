"""Image-text-to-text models in the transformers engine: `AutoProcessor` +
`AutoModelForImageTextToText`, the model's own chat template with the request's images.

The simpler path, documented: a vision model answers one request at a time through
`model.generate` (no continuous batching, no prefix cache), text-only chats included, because the
batched generator drives a decoder-only KV layout with token ids alone, while each vision family
merges image features, and some compute positions of their own (Qwen2-VL's M-RoPE), inside its own
`generate`. Sampling stays ours: a logits processor picks each token with `sampling.sample`
(per-request seed, top-k/p, min-p, penalties, logprobs) and `generate` runs greedy over its
choice, so a vision model honours the same OpenAI parameters as a text one.

Images: OpenAI `image_url` parts with a base64 data URL (Ollama's `images` and Anthropic's image
blocks reach the engine as those). An http(s) URL is refused (400): the engine runs beside the
GPUs, often with access to a private network, and fetching whatever URL a client names would let
any client make it reach inside (SSRF). Clients send the image's bytes instead, as llama.cpp's own
web UI and the Ollama API do. A decoded image is bounded by `MAX_IMAGE_PIXELS` before its pixels
are read (a small PNG can decode to gigabytes).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from modelyard.config import TransformersModel
from modelyard.engine.backends.transformers.detok import (
    IncrementalDetokenizer,
    StopMatcher,
    TokenText,
)
from modelyard.engine.backends.transformers.generator import TokenEvent
from modelyard.engine.backends.transformers.params import InvalidParams, SamplingParams
from modelyard.engine.backends.transformers.precision import Precision
from modelyard.engine.backends.transformers.sampling import Choice, RowSampler, sample
from modelyard.engine.backends.transformers.tool_calls import template_message

log = logging.getLogger("modelyard.engine.transformers")

MAX_IMAGE_PIXELS = 40_000_000  # ~6300 x 6300; processors resize far below this anyway
MAX_IMAGES = 16  # per request


@dataclass
class LoadedVision:
    model: Any
    processor: Any
    tokenizer: Any
    precision: Precision
    device: str


def load_image_text(
    spec: TransformersModel, precision: Precision, placed: dict[str, Any] | None = None
) -> LoadedVision:
    """The model and its processor (in a worker thread: seconds to minutes). `placed`: the
    engine's placement as `from_pretrained` keywords (device_map.py), as for a causal LM."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if spec.trust_remote_code:
        log.warning("%s: trust_remote_code is on: running the repo's own Python code", spec.id)
    kwargs: dict[str, Any] = {"dtype": getattr(torch, precision.dtype),
                              "trust_remote_code": spec.trust_remote_code}
    if spec.device_map is not None:
        kwargs["device_map"] = spec.device_map
    elif torch.cuda.is_available() and placed:
        kwargs.update(placed)
    elif torch.cuda.is_available():
        kwargs["device_map"] = {"": 0}
    log.info("loading %s (image-text-to-text) from %s (%s)", spec.id, spec.path, precision.why)
    model = AutoModelForImageTextToText.from_pretrained(str(spec.path), **kwargs)
    model.eval()  # type: ignore[no-untyped-call]
    processor = AutoProcessor.from_pretrained(  # type: ignore[no-untyped-call]
        str(spec.path), trust_remote_code=spec.trust_remote_code)
    device = str(next(model.parameters()).device)
    return LoadedVision(model, processor, processor.tokenizer, precision, device)


class VisionPrompt(list[int]):
    """Prompt token ids that also carry the processor's other inputs (pixel values, image
    sizes...): what `chat_ids` hands the server, which passes it to `VisionGenerator.generate`
    unchanged, so the HTTP face is the one text models use."""

    inputs: dict[str, Any]


def decode_image(url: str, where: str) -> Any:
    """A data URL's image, as a PIL RGB image; ValueError (a 400) for anything else."""
    from PIL import Image

    if url.startswith(("http://", "https://")):
        raise ValueError(f"{where}: image URLs are not fetched by the transformers engine; "
                         "send the image inline as a data URL (data:image/png;base64,...)")
    head, sep, payload = url.partition(",")
    if not (sep and head.startswith("data:") and head.endswith(";base64")):
        raise ValueError(f"{where}: an image must be a base64 data URL "
                         "(data:image/png;base64,...)")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{where}: the image is not valid base64") from exc
    try:
        image = Image.open(io.BytesIO(raw))
        width, height = image.size  # from the header: nothing decoded yet
        if width * height > MAX_IMAGE_PIXELS:
            raise ValueError(f"{where}: the image is {width}x{height} pixels; at most "
                             f"{MAX_IMAGE_PIXELS} pixels are accepted")
        return image.convert("RGB")
    except (OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"{where}: the image cannot be decoded ({exc})") from exc


def _parts(content: Any, where: str, images: list[Any]) -> Any:
    """OpenAI content → the processor's chat-template content (images decoded into `images`)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be a string or a list of parts")
    out: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            out.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "image_url":
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            if not isinstance(url, str):
                raise ValueError(f"{where}.{k}.image_url: needs a `url`")
            if len(images) >= MAX_IMAGES:
                raise ValueError(f"{where}.{k}: at most {MAX_IMAGES} images per request")
            image = decode_image(url, f"{where}.{k}.image_url.url")
            images.append(image)
            out.append({"type": "image", "image": image})
    return out


def vision_chat_prompt(processor: Any, body: dict[str, Any]) -> VisionPrompt:
    """The processor's chat template over the request's messages, images included."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("`messages` must be a non-empty list")
    if getattr(processor, "chat_template", None) is None:
        raise ValueError("this model has no chat template")
    images: list[Any] = []
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError("each message needs a `role`")
        plain.append({**template_message(m),
                      "content": _parts(m.get("content"), f"messages.{i}.content", images)})
    inputs = processor.apply_chat_template(
        plain, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    return _prompt(dict(inputs))


def vision_completion_prompt(processor: Any, body: dict[str, Any]) -> VisionPrompt:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ValueError("`prompt` must be a string")
    return _prompt(dict(processor.tokenizer(prompt, return_tensors="pt")))


def _prompt(inputs: dict[str, Any]) -> VisionPrompt:
    prompt = VisionPrompt(int(t) for t in inputs["input_ids"][0])
    prompt.inputs = inputs
    return prompt


class VisionGenerator:
    """One request at a time on an image-text-to-text model, streamed as `TokenEvent`s."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self._model = model
        self._tokenizer = tokenizer
        # One worker thread of its own runs the requests in order, one at a time: waiting
        # requests then hold no thread of the engine's default pool (which loads and tokenizes).
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vision")
        self._lock = threading.Lock()  # the counters below
        self._token_text = TokenText(tokenizer)
        self._eos = _eos_ids(model, tokenizer)
        text_config = model.config.get_text_config()
        self._context = int(getattr(text_config, "max_position_embeddings", 0) or 0) or 4096
        self._started = 0
        self._queued = 0

    def start(self) -> None:
        """Nothing to start: the worker thread starts with the first request."""

    def stop(self) -> None:
        """Drop the queued requests and wait for the one on the model (its stream was closed,
        so it ends at its next token)."""
        self._worker.shutdown(wait=True, cancel_futures=True)

    def forget_session(self, session: str) -> None:
        """No pinned KV here (no prefix cache)."""

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"mode": "vision (one request at a time)", "started": self._started,
                    "waiting": self._queued}

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 session: str | None = None,
                 constraint: object | None = None) -> AsyncIterator[TokenEvent]:
        if constraint is not None:  # no compiler is wired for these models (backend.py)
            raise InvalidParams("this model cannot constrain its output", "response_format")
        if not prompt_ids:
            raise InvalidParams("the prompt is empty", "prompt")
        room = self._context - len(prompt_ids)
        if room < 1:
            raise InvalidParams(f"the prompt has {len(prompt_ids)} tokens; the model's context "
                                f"is {self._context}", "prompt")
        inputs = prompt_ids.inputs if isinstance(prompt_ids, VisionPrompt) else {
            "input_ids": torch.tensor([prompt_ids]),
            "attention_mask": torch.ones(1, len(prompt_ids), dtype=torch.long)}
        return self._stream(list(prompt_ids), inputs, params, min(params.max_tokens or room, room))

    async def _stream(self, prompt: list[int], inputs: dict[str, Any], params: SamplingParams,
                      max_new: int) -> AsyncIterator[TokenEvent]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        cancelled = threading.Event()

        def put(item: TokenEvent | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # that loop is closed: nobody listens any more
                cancelled.set()

        run = _Run(self, prompt, params, max_new, put, cancelled)
        with self._lock:
            self._queued += 1
        loop.run_in_executor(self._worker, run.run, inputs)  # it never raises (see `run`)
        try:
            while True:
                item = await events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            cancelled.set()  # a client that left stops the generation at its next token


class _Run:
    """One request's generation (on a worker thread)."""

    def __init__(self, owner: VisionGenerator, prompt: list[int], params: SamplingParams,
                 max_new: int, put: Callable[[TokenEvent | BaseException], None],
                 cancelled: threading.Event) -> None:
        self.owner, self.prompt, self.params, self.max_new = owner, prompt, params, max_new
        self.put, self.cancelled = put, cancelled
        self.sampler = RowSampler(params, prompt)
        self.detok = IncrementalDetokenizer(owner._tokenizer, prompt)
        self.stopper = StopMatcher(params.stop)
        self.generated: list[int] = []
        self.finished = False
        self.submitted = time.perf_counter()
        self.started = self.first = 0.0

    def run(self, inputs: dict[str, Any]) -> None:
        owner = self.owner
        with owner._lock:
            owner._queued -= 1
            if not self.cancelled.is_set():
                owner._started += 1
        if self.cancelled.is_set():
            return  # its client left while it waited
        try:
            self.started = time.perf_counter()
            self._generate(inputs)
            if not self.finished:  # cancelled: the stream's reader has gone
                self._finish("", "cancelled")
        except Exception as exc:  # a failed forward (e.g. out of memory) fails this stream only
            log.exception("vision generation failed")
            self.put(RuntimeError(f"generation failed: {type(exc).__name__}: {exc}"))

    def _generate(self, inputs: dict[str, Any]) -> None:
        from transformers import (
            GenerationConfig,
            LogitsProcessor,
            LogitsProcessorList,
            StoppingCriteria,
            StoppingCriteriaList,
        )

        run = self

        class Choose(LogitsProcessor):  # our sampler decides, greedy `generate` follows
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                choice = sample(scores[-1:], [run.sampler])[0]
                run._accept(choice)
                forced = torch.full_like(scores, float("-inf"))
                forced[:, choice.token] = 0.0
                return forced

        class Done(StoppingCriteria):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor,
                         **kwargs: Any) -> torch.Tensor:
                stop = run.finished or run.cancelled.is_set()
                return torch.full((input_ids.shape[0],), stop, dtype=torch.bool,
                                  device=input_ids.device)

        model = self.owner._model
        device = model.device
        dtype = model.dtype
        args = {k: (v.to(device, dtype) if torch.is_floating_point(v) else v.to(device))
                if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        pad = self.owner._tokenizer.pad_token_id
        config = GenerationConfig(  # type: ignore[no-untyped-call]
            max_new_tokens=self.max_new, do_sample=False,
            eos_token_id=None, pad_token_id=pad if pad is not None else 0)
        with torch.inference_mode():
            model.generate(**args, generation_config=config,
                           logits_processor=LogitsProcessorList([Choose()]),
                           stopping_criteria=StoppingCriteriaList([Done()]))

    def _accept(self, choice: Choice) -> None:
        if self.finished:
            return
        token = choice.token
        self.generated.append(token)
        if len(self.generated) == 1:
            self.first = time.perf_counter()
        eos = token in self.owner._eos and not self.params.ignore_eos
        text = "" if eos else self.stopper.feed(self.detok.add(token))
        finish: str | None = None
        if eos or self.stopper.stopped:
            finish = "stop"
        elif len(self.generated) >= self.max_new:
            finish = "length"
        if finish is not None and not self.stopper.stopped:
            text += self.stopper.feed(self.detok.finish())
            if self.stopper.stopped:
                finish = "stop"
            text += self.stopper.flush()
        logprobs = None
        if self.params.logprobs is not None:
            logprobs = [] if eos else [self._logprob_entry(choice)]
        if finish is not None:
            self._finish(text, finish, [token], logprobs)
        else:
            self.put(TokenEvent(text, [token], logprobs, None))

    def _finish(self, text: str, reason: str, ids: list[int] | None = None,
                logprobs: list[dict[str, Any]] | None = None) -> None:
        self.finished = True
        now = time.perf_counter()
        first, started = self.first or now, self.started or now
        event = TokenEvent(text, ids or [], logprobs, reason)
        event.usage = {"prompt_tokens": len(self.prompt),
                       "completion_tokens": len(self.generated), "cached_tokens": 0}
        event.timings = {
            "queue_ms": 1e3 * (started - self.submitted),
            "prefill_ms": 1e3 * (first - started) if self.generated else 0.0,
            "ttft_ms": 1e3 * (first - self.submitted) if self.generated else 0.0,
            "decode_ms": 1e3 * (now - first) if self.generated else 0.0,
        }
        self.put(event)

    def _logprob_entry(self, choice: Choice) -> dict[str, Any]:
        text, raw = self.owner._token_text(choice.token)
        top = []
        for token, logprob in choice.top or []:
            t_text, t_raw = self.owner._token_text(token)
            top.append({"token": t_text, "logprob": logprob, "bytes": t_raw})
        return {"token": text, "logprob": choice.logprob, "bytes": raw, "top_logprobs": top}


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None),
                   model.config.get_text_config(), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(i for i in ids if i >= 0)
