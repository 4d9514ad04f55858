"""What the APIs hand to the archive: service outputs (by default) and chat transcripts (when
asked), whether the answer is streamed or whole.

Asking, per request: the header `X-Modelyard-Archive: <retention>|on|off`, or on the chat APIs
the body field `"archive"` (the same values, or true/false; it is removed before the request goes
to the backend). The header wins over the field. `on` (or true) keeps the item for the token's or
the user's default retention, else the server's `archive_retention`. Image, speech and
transcription outputs are archived unless the request says `off` (or `archive_service_outputs`
is false and the request does not ask).

A request that does not ask gets no capture and runs the unchanged code: no copies, no parsing.
A stream is tapped, never buffered before the client: each chunk goes on at once and the tap
keeps a reference to it (OpenAI SSE) or reads the `Generation` the translator fills anyway
(Ollama, native). The save is spawned after the last chunk, or when the client leaves (then the
transcript holds what was produced, with `complete: false`), and never awaited by the response.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.background import BackgroundTask
from starlette.responses import Response

from modelyard.errors import InvalidRequest
from modelyard.front.archive.store import (
    ArchiveStore,
    NewItem,
    effective_retention,
    extension_for,
    new_item_id,
    parse_retention,
)
from modelyard.front.chat.translate import Generation, rfc3339
from modelyard.front.identity.principal import Principal
from modelyard.front.sse import DONE, readable_events

HEADER = "x-modelyard-archive"
ID_HEADER = "X-Modelyard-Archive-Id"  # the id a chat transcript will be saved under
BODY_FIELD = "archive"
_OFF = frozenset({"off", "no", "false", "0"})
_ON = frozenset({"on", "yes", "true", "1", ""})
_TEXT_LIMIT = 1000  # characters of a prompt or input kept in an item's meta
# Request fields that are the transcript itself or transport, not generation parameters.
_NOT_PARAMETERS = frozenset({"model", "messages", "prompt", "stream", "stream_options",
                             BODY_FIELD})


def _said(value: object, param: str) -> str | bool:
    """False: off; True: on, default retention; a string: that retention."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _OFF:
        return False
    if isinstance(value, str) and value.strip().lower() in _ON:
        return True
    if not isinstance(value, str):
        raise InvalidRequest(f"{param}: must be a retention (1h|1d|1w|1m|1y|never), on or off",
                             param=param)
    return parse_retention(value, param)


@dataclass(frozen=True)
class Plan:
    """Archive this answer: where, for whom, for how long."""

    store: ArchiveStore
    owner: str | None
    retention: str
    # Known before the answer, so a chat response can name it in X-Modelyard-Archive-Id.
    item_id: str = field(default_factory=new_item_id)

    async def save(self, item: NewItem, *, announced: bool = False) -> None:
        await self.store.save(self.owner, self.retention, item,
                              self.item_id if announced else None)


def plan_for(store: ArchiveStore, principal: Principal, header: str | None, *,
             default_on: bool, body_value: object = None) -> Plan | None:
    """The plan when a request's answer is to be archived, else None: `header` is its
    X-Modelyard-Archive (None: not sent), `body_value` its `archive` field's; the API layer
    decides it once (front/request_context.py)."""
    if header is not None:
        said: str | bool | None = _said(header, "X-Modelyard-Archive")
    elif body_value is not None:
        said = _said(body_value, BODY_FIELD)
    else:
        said = None
    if said is False or (said is None and not default_on):
        return None
    retention = said if isinstance(said, str) else effective_retention(
        None, principal, store.default_retention)
    return Plan(store, principal.user, retention)


def _stamp(now: float) -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))


class _Tap:
    """Passes chunks through; calls `on_end(chunks, finished)` once, when the stream ends or
    the response does (a client that left never resumes the body iterator)."""

    def __init__(self, on_end: Callable[[list[bytes], bool], None], keep: bool) -> None:
        self.on_end = on_end
        self.chunks: list[bytes] = []
        self.keep = keep
        self.finished = False
        self._ended = False

    async def wrap(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                if self.keep:
                    self.chunks.append(chunk)
                yield chunk
            self.finished = True
        finally:
            self.end()

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self.on_end(self.chunks, self.finished)


# ---- chat transcripts ---------------------------------------------------------------------------


class ChatCapture:
    """One chat or completion answer to archive as a JSON transcript.

    `request` is the request in the OpenAI shape (`messages` or `prompt`, and its parameters):
    the transcript is its messages followed by the answer."""

    def __init__(self, plan: Plan, *, api: str, endpoint: str, model: str,
                 request: dict[str, Any], stream: bool) -> None:
        self.plan = plan
        self.api = api
        self.endpoint = endpoint
        self.model = model
        self.request = request
        self.stream = stream
        self.created_at = time.time()
        self._tap: _Tap | None = None
        self._answered = False  # a tool loop's exchange was saved

    # Whole answers.

    def save_response(self, body: bytes) -> None:
        """An OpenAI JSON answer, as the backend sent it."""
        self.plan.store.spawn(self._save_parsed([body], stream=False, finished=True))

    def save_generation(self, gen: Generation) -> None:
        self._save(gen, complete=gen.finish_reason is not None)

    def save_exchange(self, messages: list[dict[str, Any]], answer: dict[str, Any]) -> None:
        """A tool loop's answer (a chat completion) after `messages`, the conversation with
        its tool rounds: the transcript shows the whole exchange."""
        self._answered = True
        self.request = {**self.request, "messages": messages}
        gen = Generation.start()
        gen.absorb(answer)
        self.save_generation(gen)

    # Streams.

    def tap_sse(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """An OpenAI SSE stream passed through unchanged; its events are read after it ends."""
        def end(kept: list[bytes], finished: bool) -> None:
            self.plan.store.spawn(self._save_parsed(kept, stream=True, finished=finished))

        self._tap = _Tap(end, keep=True)
        return self._tap.wrap(chunks)

    def tap_generation(self, chunks: AsyncIterator[bytes], gen: Generation
                       ) -> AsyncIterator[bytes]:
        """A translated stream: `gen` (filled by the translator) holds the answer."""
        def end(_kept: list[bytes], finished: bool) -> None:
            self._save(gen, complete=finished and gen.finish_reason is not None)

        self._tap = _Tap(end, keep=False)
        return self._tap.wrap(chunks)

    def tap_exchange(self, chunks: AsyncIterator[bytes],
                     so_far: Callable[[], list[dict[str, Any]]]) -> AsyncIterator[bytes]:
        """A streamed tool loop: the response names its item before the loop ends, so one that
        ends before `save_exchange` (a round failed in-band, the client left mid-loop) saves
        the conversation `so_far`, marked incomplete."""
        def end(_kept: list[bytes], _finished: bool) -> None:
            if not self._answered:
                self.request = {**self.request, "messages": list(so_far())}
                self._save(Generation.start(), complete=False)

        self._tap = _Tap(end, keep=False)
        return self._tap.wrap(chunks)

    def attach(self, response: Response) -> Response:
        """Make the response end the tap when it ends, also when the client left mid-stream
        (then the body iterator is never resumed, so its own `finally` may come much later),
        and name the item the transcript will be saved as."""
        assert response.background is None
        response.background = BackgroundTask(self._end_tap)
        response.headers[ID_HEADER] = self.plan.item_id
        return response

    def _end_tap(self) -> None:
        if self._tap is not None:  # None: the stream never reached the answer (an error)
            self._tap.end()

    # Saving (in the background: the response never waits for it).

    def _save(self, gen: Generation, *, complete: bool) -> None:
        self.plan.store.spawn(self._write(gen, complete))

    async def _save_parsed(self, chunks: list[bytes], *, stream: bool, finished: bool) -> None:
        gen, done = await asyncio.to_thread(_parse_openai, chunks, stream)
        await self._write(gen, finished and (done or gen.finish_reason is not None))

    async def _write(self, gen: Generation, complete: bool) -> None:
        doc = transcript(self, gen, complete=complete)
        data = await asyncio.to_thread(orjson.dumps, doc, option=orjson.OPT_INDENT_2)
        meta = {"api": self.api, "endpoint": self.endpoint, "stream": self.stream,
                "complete": complete, "finish_reason": gen.finish_reason,
                "usage": doc.get("usage"), "title": _title(self.request)}
        await self.plan.save(NewItem(
            kind="chat", data=data, media_type="application/json", model=self.model, meta=meta,
            filename=f"chat-{self.model}-{_stamp(self.created_at)}.json",
        ), announced=True)


def transcript(capture: ChatCapture, gen: Generation, *, complete: bool) -> dict[str, Any]:
    request = capture.request
    doc: dict[str, Any] = {
        "model": capture.model, "api": capture.api, "endpoint": capture.endpoint,
        "created_at": rfc3339(capture.created_at), "stream": capture.stream,
        "complete": complete,
    }
    if "messages" in request:
        doc["messages"] = [*request["messages"], {"role": "assistant", "content": gen.content}]
    else:
        doc["prompt"] = request.get("prompt")
        doc["completion"] = gen.content
    doc["parameters"] = {k: v for k, v in request.items() if k not in _NOT_PARAMETERS}
    doc["finish_reason"] = gen.finish_reason
    if gen.prompt_tokens or gen.completion_tokens:
        doc["usage"] = {"prompt_tokens": gen.prompt_tokens,
                        "completion_tokens": gen.completion_tokens,
                        "total_tokens": gen.prompt_tokens + gen.completion_tokens}
    return doc


def _parse_openai(chunks: list[bytes], stream: bool) -> tuple[Generation, bool]:
    """The answer in an OpenAI body or SSE stream, and whether the stream reached [DONE]."""
    gen = Generation.start()
    body = b"".join(chunks)
    if not stream:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return gen, False
        if isinstance(data, dict):
            gen.absorb(data)
        return gen, True
    done = False
    for event in readable_events(body.split(b"\n")):
        if event == DONE:
            done = True
        elif "error" not in event:
            gen.absorb(event)
    return gen, done


def _title(request: dict[str, Any]) -> str:
    """The first user message (or the prompt), shortened: what a list of transcripts shows."""
    text: Any = request.get("prompt")
    for message in request.get("messages") or []:
        if isinstance(message, dict) and message.get("role") == "user":
            text = message.get("content")
            break
    if isinstance(text, list):  # content parts, or a list of prompts
        text = " ".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in text)
    title = " ".join(str(text or "").split())
    return title if len(title) <= 80 else title[:79] + "…"


def chat_capture(plan: Plan | None, data: dict[str, Any], *, api: str, endpoint: str,
                 model: str, stream: bool) -> ChatCapture | None:
    """The capture of a chat request whose context has an archive `plan` (None: not asked, no
    capture). `data`: the request in the OpenAI shape."""
    if plan is None:
        return None
    return ChatCapture(plan, api=api, endpoint=endpoint, model=model, request=data,
                       stream=stream)


# ---- service outputs ----------------------------------------------------------------------------


_IMAGE_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"),
                (b"GIF87a", "image/gif"), (b"GIF89a", "image/gif"))


def image_media_type(data: bytes, asked_format: object = None) -> str:
    for magic, media_type in _IMAGE_MAGIC:
        if data.startswith(magic):
            return media_type
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if isinstance(asked_format, str) and asked_format.lower() in ("png", "jpeg", "webp"):
        return f"image/{asked_format.lower()}"
    return "application/octet-stream"


class ServiceCapture:
    """The output of an image, speech or transcription service, saved once it is complete."""

    def __init__(self, plan: Plan, *, kind: str, model: str, request_body: bytes,
                 request_type: str) -> None:
        self.plan = plan
        self.kind = kind
        self.model = model
        self.media_type = "application/octet-stream"  # the service's, once it answers
        self.request_body = request_body
        self.request_type = request_type
        self.created_at = time.time()

    def tap(self, chunks: AsyncIterator[bytes], media_type: str) -> AsyncIterator[bytes]:
        """The service's answer (of `media_type`) passed through as it comes."""
        self.media_type = media_type

        def end(kept: list[bytes], finished: bool) -> None:
            if finished:  # a cut-off file is no use: only whole outputs are kept
                self.plan.store.spawn(self._save(kept))

        return _Tap(end, keep=True).wrap(chunks)

    async def _save(self, chunks: list[bytes]) -> None:
        for item in await asyncio.to_thread(self.items, b"".join(chunks)):
            await self.plan.save(item)

    def _request_json(self) -> dict[str, Any]:
        if not self.request_type.startswith("application/json"):
            return {}
        try:
            data = orjson.loads(self.request_body)
        except orjson.JSONDecodeError:
            return {}
        return data if isinstance(data, dict) else {}

    def items(self, body: bytes) -> list[NewItem]:
        """What to archive of this output: each image of an image answer, else the body."""
        request = self._request_json()
        stem = f"{self.kind}-{self.model}-{_stamp(self.created_at)}"
        meta: dict[str, Any] = {}
        for key in ("prompt", "input", "voice"):
            if isinstance(request.get(key), str):
                meta[key] = request[key][:_TEXT_LIMIT]
        if self.kind == "image":
            images = _decoded_images(body)
            if images:
                out = []
                for i, (data, revised) in enumerate(images):
                    media_type = image_media_type(data, request.get("output_format"))
                    extra: dict[str, Any] = {"index": i, "count": len(images)}
                    if revised:
                        extra["revised_prompt"] = revised[:_TEXT_LIMIT]
                    name = stem + (f"-{i + 1}" if len(images) > 1 else "")
                    out.append(NewItem("image", data, media_type, name + extension_for(media_type),
                                       self.model, {**meta, **extra}))
                return out
        return [NewItem(self.kind, body, self.media_type, stem + extension_for(self.media_type),
                        self.model, meta)]


def _decoded_images(body: bytes) -> list[tuple[bytes, str | None]]:
    """The images inlined (`b64_json`) in an OpenAI images answer; [] when it has only URLs or
    is not one (then the answer itself is archived)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return []
    entries = data.get("data") if isinstance(data, dict) else None
    out: list[tuple[bytes, str | None]] = []
    for entry in entries if isinstance(entries, list) else []:
        encoded = entry.get("b64_json") if isinstance(entry, dict) else None
        if not isinstance(encoded, str):
            return []
        try:
            image = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            return []
        revised = entry.get("revised_prompt")
        out.append((image, revised if isinstance(revised, str) else None))
    return out
