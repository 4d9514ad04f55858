"""The OpenAI-speaking HTTP face of an in-process transformers model.

The engine serves each transformers model on a loopback port of its own, so the front relays to
it exactly as it relays to llama-server: same routes, same response shapes (including
llama-server's `timings`, which the Ollama API turns into its statistics).

    GET  /health                  200 once the model is loaded
    POST /v1/chat/completions     the model's chat template; JSON or SSE
    POST /v1/completions          a raw prompt; JSON or SSE (`echo` with an integer
                                  `logprobs` scores the prompt: scoring.py)
    POST /v1/embeddings           (embedding models)
    POST /v1/rerank               (cross-encoders: raw scores of every document, rerank_shapes)
    DELETE /sessions/{key}        drop a chat session's pinned KV (204, known or not)

Several choices (`n`): each is a sequence of its own in the generator's batch, queued together
(the prefix cache lets the later ones reuse the prompt's KV), seeded with the request's seed plus
its index; their chunks are interleaved as they come, each with its `index`, and the usage is
the whole request's (the prompt once, the completions added up).

Chat sessions: the front marks a request that belongs to one of its server-side chat sessions
with the body field `x_modelyard_session` (an opaque key, at most 128 characters). It is taken out
of the body before the chat template and the sampling parameters see it, and handed to the
generator, which keeps the session's conversation KV pinned apart from the prefix cache (see
`session_pins.py`); a pinned hit is reported like any cache reuse, in
`usage.prompt_tokens_details.cached_tokens` and `timings.cache_n`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelyard.engine.backends.transformers import grammars, scoring, tool_calls
from modelyard.engine.backends.transformers.generator import BatchGenerator, TokenEvent
from modelyard.engine.backends.transformers.params import (
    ContextOverflow,
    InvalidParams,
    SamplingParams,
    choices_of,
)
from modelyard.engine.backends.transformers.session_pins import valid_session_key
from modelyard.engine.speculative import off_header_value
from modelyard.wire.speculative import SPECULATIVE_HEADER

if TYPE_CHECKING:
    from modelyard.engine.backends.transformers.vision import VisionGenerator

Tokenize = Callable[[dict[str, Any]], list[int]]

SESSION_FIELD = "x_modelyard_session"


def error(status: int, message: str, param: str | None = None,
          kind: str = "invalid_request_error", code: str | int | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param,
                      "code": status if code is None else code}}
    return JSONResponse(body, status_code=status)


def sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + \
        b"\n\n"


def timings(last: TokenEvent) -> dict[str, Any]:
    """llama-server's `timings` fields, from the generator's own."""
    t = last.timings or {}
    usage = last.usage or {}
    prompt_ms = float(t.get("prefill_ms", 0.0))
    predicted_ms = float(t.get("decode_ms", 0.0))
    n_prompt, n_pred = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    return {
        "cache_n": int(usage.get("cached_tokens", 0)),
        "prompt_n": n_prompt, "prompt_ms": prompt_ms,
        "prompt_per_second": 1e3 * n_prompt / prompt_ms if prompt_ms else 0.0,
        "predicted_n": n_pred, "predicted_ms": predicted_ms,
        "predicted_per_second": 1e3 * n_pred / predicted_ms if predicted_ms else 0.0,
        "ttft_ms": float(t.get("ttft_ms", 0.0)), "queue_ms": float(t.get("queue_ms", 0.0)),
    }


def usage_of(*lasts: TokenEvent) -> dict[str, Any]:
    """The usage of a request whose choices ended with `lasts`: the prompt they share once (its
    reuse: the least any choice had cached), the completions added up."""
    us = [last.usage or {} for last in lasts]
    prompt = max(int(u.get("prompt_tokens", 0)) for u in us)
    completion = sum(int(u.get("completion_tokens", 0)) for u in us)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {
                "cached_tokens": min(int(u.get("cached_tokens", 0)) for u in us)}}


def timings_of(*lasts: TokenEvent) -> dict[str, Any]:
    """`timings` of a request whose choices ended with `lasts`."""
    out = timings(lasts[0])
    if len(lasts) > 1:
        usage = usage_of(*lasts)
        every = [timings(last) for last in lasts]
        out["cache_n"] = usage["prompt_tokens_details"]["cached_tokens"]
        out["prompt_n"] = usage["prompt_tokens"] - out["cache_n"]
        out["predicted_n"] = usage["completion_tokens"]
        out["predicted_ms"] = max(t["predicted_ms"] for t in every)
        ms = out["predicted_ms"]
        out["predicted_per_second"] = 1e3 * out["predicted_n"] / ms if ms else 0.0
    return out


class Completion:
    """One request: its ids, its envelope, and the two ways of answering it."""

    def __init__(self, model_name: str, chat: bool, body: dict[str, Any],
                 tool_family: tool_calls.Family | None = None) -> None:
        self.model_name = model_name
        self.chat = chat
        # Parse tool calls out of the answer only when the request offers tools.
        offered = chat and bool(body.get("tools")) and body.get("tool_choice") != "none"
        self.tool_family = tool_family if offered else None
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        options = body.get("stream_options")
        self.include_usage = isinstance(options, dict) and bool(options.get("include_usage"))

    def envelope(self, choices: list[Any], **extra: Any) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.model_name, "choices": choices, **extra}

    def chunk_choice(self, event: TokenEvent, first: bool, index: int = 0) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": event.finish_reason}
        if event.finish_reason == "stop" and event.stop_sequence is not None:
            choice["stop_reason"] = event.stop_sequence  # vLLM's field: the stop string hit
        if self.chat:
            delta: dict[str, Any] = {"content": event.text} if event.text else {}
            if isinstance(event, _ToolDeltas):
                delta = dict(event.delta)
            if first:
                delta = {"role": "assistant", **delta}
            choice["delta"] = delta
        else:
            choice["text"] = event.text
        if event.logprobs is not None:
            choice["logprobs"] = {"content": event.logprobs}
        return choice

    async def stream(self, streams: list[AsyncIterator[TokenEvent]]) -> AsyncIterator[bytes]:
        """The choices' chunks as they come (interleaved when several), then the usage (when
        asked) and `[DONE]`."""
        sources = [self._chunks(events, index) for index, events in enumerate(streams)]
        chunks = sources[0] if len(sources) == 1 else _merged(sources)
        lasts: list[TokenEvent] = []
        try:
            async for chunk, last in chunks:
                yield sse(chunk)
                if last is not None:
                    lasts.append(last)
            if self.include_usage and lasts:
                tail = self.envelope([], usage=usage_of(*lasts))
                tail["object"] = "chat.completion.chunk" if self.chat else "text_completion"
                yield sse(tail)
            yield b"data: [DONE]\n\n"
        finally:
            await _close(chunks)  # a client that left cancels its sequences

    async def _chunks(self, events: AsyncIterator[TokenEvent], index: int
                      ) -> AsyncIterator[tuple[dict[str, Any], TokenEvent | None]]:
        """One choice's chunks, each with the choice's last event on the finishing one."""
        if self.tool_family is not None:
            events = self._with_tool_calls(events, self.tool_family)
        first = True
        try:
            async for event in events:
                chunk = self.envelope([self.chunk_choice(event, first, index)])
                if self.chat:
                    chunk["object"] = "chat.completion.chunk"
                first = False
                if event.finish_reason is not None:
                    chunk["timings"] = timings(event)
                    yield chunk, event
                    break
                if event.text or event.logprobs or isinstance(event, _ToolDeltas):
                    yield chunk, None
        finally:
            await _close(events)

    async def _with_tool_calls(
        self, events: AsyncIterator[TokenEvent], family: tool_calls.Family
    ) -> AsyncIterator[Any]:
        """Text streams as usual until a tool-call marker begins; from there the text is held
        back, and at the end it goes out as OpenAI tool-call deltas (`_ToolDeltas`)."""
        sent, held = "", ""  # text streamed; text held back (a marker or maybe one)
        calling = False
        try:
            async for event in events:
                held += event.text
                if not calling:
                    at = tool_calls.marker_at(sent + held, family)
                    if at >= 0 and at >= len(sent):
                        calling = True
                        out, held = held[:at - len(sent)], held[at - len(sent):]
                    else:
                        keep = tool_calls.may_become_marker(held, family)
                        if family == "llama3" and not (sent + held).strip():
                            keep = len(held)
                        out, held = held[:len(held) - keep], held[len(held) - keep:]
                    sent += out
                    if event.finish_reason is None:
                        if out or event.logprobs:
                            yield _replace(event, out)
                        continue
                    if out:
                        yield _replace(event, out, finish=None)
                if event.finish_reason is None:
                    continue
                _, calls = tool_calls.parse(held, family) if held else (None, [])
                if not calls:
                    yield _replace(event, held)
                    return
                for delta in tool_calls.stream_deltas(calls):
                    yield _ToolDeltas(delta, event)
                yield _replace(event, "", finish="tool_calls")
                return
        finally:
            await _close(events)

    async def whole(self, streams: list[AsyncIterator[TokenEvent]]) -> dict[str, Any]:
        if len(streams) == 1:
            done = [await self._whole_choice(streams[0], 0)]
        else:
            try:
                async with asyncio.TaskGroup() as group:  # one failing cancels the others
                    tasks = [group.create_task(self._whole_choice(events, index))
                             for index, events in enumerate(streams)]
            finally:
                for events in streams:
                    await _close(events)
            done = [task.result() for task in tasks]
        lasts = [last for _, last in done]
        return self.envelope([choice for choice, _ in done], usage=usage_of(*lasts),
                             timings=timings_of(*lasts))

    async def _whole_choice(self, events: AsyncIterator[TokenEvent], index: int
                            ) -> tuple[dict[str, Any], TokenEvent]:
        text, logprobs, last = [], [], None
        try:
            async for event in events:
                text.append(event.text)
                if event.logprobs:
                    logprobs += event.logprobs
                last = event
        finally:
            await _close(events)
        assert last is not None
        choice: dict[str, Any] = {"index": index, "finish_reason": last.finish_reason,
                                  "logprobs": {"content": logprobs} if logprobs else None}
        if self.chat:
            message, reason = tool_calls.openai_message("".join(text), self.tool_family)
            choice["message"] = message
            if reason is not None:
                choice["finish_reason"] = reason
        else:
            choice["text"] = "".join(text)
        if choice["finish_reason"] == "stop" and last.stop_sequence is not None:
            choice["stop_reason"] = last.stop_sequence  # vLLM's field: the stop string hit
        return choice, last


async def _merged(sources: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """The items of several async iterators as each comes; closing it closes them all."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(source: AsyncIterator[Any]) -> None:
        try:
            async for item in source:
                await queue.put((0, item))
            await queue.put((1, None))
        except Exception as exc:  # re-raised by the reader
            await queue.put((2, exc))

    tasks = [asyncio.create_task(pump(source)) for source in sources]
    try:
        left = len(tasks)
        while left:
            kind, item = await queue.get()
            if kind == 2:
                raise item
            if kind == 1:
                left -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for source in sources:
            await _close(source)


class _ToolDeltas:
    """A stream step that carries a tool-call delta instead of text (no finish)."""

    def __init__(self, delta: dict[str, Any], like: TokenEvent) -> None:
        self.delta = delta
        self.text = ""
        self.logprobs = None
        self.finish_reason = None
        self._like = like

    def __getattr__(self, name: str) -> Any:
        return getattr(self._like, name)


_KEEP: Any = object()


def _replace(event: TokenEvent, text: str, finish: Any = _KEEP) -> TokenEvent:
    """`event` with other text (and, given, another finish_reason)."""
    if finish is _KEEP:
        return dataclasses.replace(event, text=text)
    return dataclasses.replace(event, text=text, finish_reason=finish)


async def _close(events: AsyncIterator[Any]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling: the request's seed plus the index (llama-server's way), so a
    seeded request's choices differ and each is reproducible."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) & 0xFFFF_FFFF_FFFF_FFFF)


Constrain = Callable[[dict[str, Any], bool, "tool_calls.Family | None"], Any]


async def _constraint(constrain: Constrain | None, body: dict[str, Any], chat: bool,
                      family: tool_calls.Family | None) -> Any:
    if constrain is not None:
        return await asyncio.to_thread(constrain, body, chat, family)
    if grammars.request_grammar(body, chat, family) is not None:  # (raises for a bad one)
        raise grammars.InvalidGrammar("this model cannot constrain its output",
                                      "response_format", "unsupported_constraint")
    return None


def build_app(
    model_name: str,
    generator: BatchGenerator | VisionGenerator | None,
    chat_ids: Tokenize,
    prompt_ids: Tokenize,
    embed: Callable[[dict[str, Any]], Any] | None = None,
    tool_family: tool_calls.Family | None = None,
    rerank: Callable[[dict[str, Any]], Any] | None = None,
    constrain: Constrain | None = None,
    speculative_off: str | None = None,
) -> Starlette:
    """`chat_ids`/`prompt_ids` turn a request body into prompt token ids (raising ValueError
    with a message for a body they cannot use). `constrain(body, chat, family)` (blocking) gives
    the grammar matcher a request's `response_format` / forced `tool_choice` asks for, or None,
    raising `grammars.InvalidGrammar`; without it such requests are refused. `speculative_off`:
    the model has a `draft_model` this engine does not use, and every answer says why in
    `X-Modelyard-Speculative: off; reason="…"` (set here, so the front relays it at no cost)."""

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def complete(request: Request, chat: bool) -> Response:
        if generator is None:
            use = "/v1/rerank" if rerank is not None else "/v1/embeddings"
            return error(400, f"'{model_name}' does not generate text: use {use}", "model")
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return error(400, f"request body is not JSON: {exc}")
        if not isinstance(body, dict):
            return error(400, "request body must be a JSON object")
        if (k := scoring.scored_alternatives(body, chat)) is not None:
            return await _score(body, k)
        session = body.pop(SESSION_FIELD, None)  # not a template variable nor a sampling field
        if session is not None and (problem := valid_session_key(session)) is not None:
            return error(400, problem, SESSION_FIELD)
        try:
            params = SamplingParams.from_openai(body)
        except InvalidParams as exc:
            return error(400, str(exc), exc.param)
        try:
            ids = await asyncio.to_thread(chat_ids if chat else prompt_ids, body)
        except (ValueError, TypeError, KeyError) as exc:
            return error(400, str(exc), "messages" if chat else "prompt")
        family = grammars.parse_family(body, tool_family) if chat else None
        try:
            n = choices_of(body)
            # a grammar's matcher is one sequence's own: one per choice
            constraints = [await _constraint(constrain, body, chat, family) for _ in range(n)]
        except grammars.InvalidGrammar as exc:
            return error(400, str(exc), exc.param, code=exc.code)
        except InvalidParams as exc:
            return error(400, str(exc), exc.param)
        completion = Completion(model_name, chat, body, family)
        streams: list[AsyncIterator[TokenEvent]] = []
        try:
            for index, constraint in enumerate(constraints):
                streams.append(generator.generate(
                    ids, _choice_params(params, index), constraint=constraint,
                    session=session if index == 0 else None))  # one answer continues a session
        except (ContextOverflow, InvalidParams) as exc:
            for events in streams:
                await _close(events)
            if isinstance(exc, ContextOverflow):  # llama-server's shape: the front reads both
                return JSONResponse(exc.llama_server_body(), status_code=400)
            return error(400, str(exc), exc.param)  # an empty prompt
        if body.get("stream"):
            return StreamingResponse(completion.stream(streams), media_type="text/event-stream")
        return JSONResponse(await completion.whole(streams))

    async def _score(body: dict[str, Any], k: int) -> Response:
        """`echo` with an integer `logprobs`: the prompt's log probabilities (scoring.py)."""
        if not isinstance(generator, BatchGenerator):
            return error(400, f"'{model_name}' cannot score a prompt (`echo` with `logprobs`)",
                         "echo", code="prompt_logprobs_unsupported")
        try:
            answer = await scoring.answer(
                generator, body, k, model_name, prompt_ids, generator.token_text,
                lambda events: Completion(model_name, False, body).whole([events]))
        except ContextOverflow as exc:
            return JSONResponse(exc.llama_server_body(), status_code=400)
        except InvalidParams as exc:
            return error(400, str(exc), exc.param)
        except (ValueError, TypeError, KeyError) as exc:
            return error(400, str(exc), "prompt")
        if not body.get("stream"):
            return JSONResponse(answer)
        usage = answer.pop("usage")  # one chunk: everything is known before the first byte
        options = body.get("stream_options")
        chunks = [sse({**answer, "usage": None})]
        if isinstance(options, dict) and options.get("include_usage"):
            chunks.append(sse({**answer, "choices": [], "usage": usage}))
        return Response(b"".join(chunks) + b"data: [DONE]\n\n", media_type="text/event-stream")

    async def chat_route(request: Request) -> Response:
        return await complete(request, chat=True)

    async def completions_route(request: Request) -> Response:
        return await complete(request, chat=False)

    async def forget_session(request: Request) -> Response:
        if generator is not None:
            generator.forget_session(request.path_params["key"])
        return Response(status_code=204)

    async def stats(_: Request) -> Response:
        return JSONResponse(generator.stats() if generator is not None else {})

    async def embeddings(request: Request) -> Response:
        if embed is None:
            return error(400, f"'{model_name}' is not an embedding model", "model")
        try:
            body = json.loads(await request.body())
            return JSONResponse(await asyncio.to_thread(embed, body))
        except ValueError as exc:  # InvalidParams of either kind name the field
            return error(400, str(exc), getattr(exc, "param", None))

    async def rerank_route(request: Request) -> Response:
        if rerank is None:
            return error(400, f"'{model_name}' is not a reranker", "model")
        try:
            body = json.loads(await request.body())
            return JSONResponse(await asyncio.to_thread(rerank, body))
        except ValueError as exc:  # InvalidParams name the field
            return error(400, str(exc), getattr(exc, "param", None))

    routes = [
        Route("/v1/rerank", rerank_route, methods=["POST"]),
        Route("/health", health), Route("/v1/health", health), Route("/stats", stats),
        Route("/v1/chat/completions", chat_route, methods=["POST"]),
        Route("/chat/completions", chat_route, methods=["POST"]),
        Route("/v1/completions", completions_route, methods=["POST"]),
        Route("/completions", completions_route, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/sessions/{key}", forget_session, methods=["DELETE"]),
    ]
    middleware = [] if speculative_off is None else [
        Middleware(_AddHeader, name=SPECULATIVE_HEADER,
                   value=off_header_value(speculative_off))]
    return Starlette(routes=routes, middleware=middleware)


class _AddHeader:
    """Pure ASGI: one header on every HTTP response, streamed ones included (it is added to
    the response's start message, before any body)."""

    def __init__(self, app: ASGIApp, name: str, value: str) -> None:
        self.app = app
        self.header = (name.lower().encode("latin-1"), value.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, sending)
