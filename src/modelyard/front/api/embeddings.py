"""Embeddings: OpenAI `POST /v1/embeddings`, Ollama `POST /api/embed` and `POST /api/embeddings`.

Every backend is asked in OpenAI's shape, `POST {upstream}/v1/embeddings` (the transformers
backend, llama-server with `--embeddings`, any OpenAI server; a `service` model at the path its
`paths.embeddings` names). The OpenAI route checks the
request (a bad one is a 400 before any load) and relays its bytes unchanged, and the answer back
unchanged; the Ollama routes translate both ways (modelyard.embeddings_shapes, shared with the
engine and free of torch). Errors come in each API's own shape: ours through front/app.py's
`render_error`, a backend's 4xx/5xx passed through (OpenAI) or re-worded (`{"error": …}`).
A model that does not embed is refused before any load (front/api/model_kind.py). Token ids as
`input` are decoded to text here when the model's `token_ids` setting says they are tiktoken's
(front/api/token_ids.py); a request of text is untouched by that.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard.config import ModelSpec, ServiceModel
from modelyard.embeddings_shapes import (
    EmbeddingRequest,
    EmbeddingResult,
    openai_body,
    parse_ollama_embed,
    parse_ollama_embeddings,
    parse_openai_request,
    read_openai_response,
    render_ollama_embed,
    render_ollama_embeddings,
)
from modelyard.errors import ModelyardError, UpstreamError
from modelyard.front.api.model_kind import require_kind
from modelyard.front.api.ollama import keep_alive_seconds
from modelyard.front.api.token_ids import decode_cl100k
from modelyard.front.dispatch.relay import passthrough_error
from modelyard.front.state import (
    FrontState,
    read_json_object,
    request_priority,
    state_of,
    upstream_message,
)

PATH = "/v1/embeddings"  # what every backend serves


def _spec(state: FrontState, model: str) -> ModelSpec | None:
    try:
        return state.catalog.registry.resolve(model).spec
    except ModelyardError:
        return None  # open_relay resolves it again (pulling it, with auto_pull) or says why


def upstream_path(state: FrontState, model: str) -> str:
    """Where the model's backend takes embeddings: /v1/embeddings, or the route a `service`
    model declares for `embeddings` in its `paths`."""
    spec = _spec(state, model)
    if isinstance(spec, ServiceModel):
        return spec.paths.get("embeddings", PATH)
    return PATH


async def as_text(state: FrontState, req: EmbeddingRequest) -> EmbeddingRequest:
    """`req` with token ids decoded to texts when they are tiktoken's (the model's `token_ids`
    setting, tiktoken for a model not yet in the catalog); the model's own ids stay as sent."""
    if req.token_ids is None:
        return req
    spec = _spec(state, req.model)
    if spec is not None and spec.token_ids == "model":
        return req
    texts = await asyncio.to_thread(decode_cl100k, req.token_ids)
    return dataclasses.replace(req, texts=texts, token_ids=None)


async def openai_embeddings(request: Request) -> Response:
    state = state_of(request)
    body = await request.body()
    data = await read_json_object(request)
    req = parse_openai_request(data)
    await require_kind(state, req.model, "embedding")
    if req.token_ids is not None:
        decoded = await as_text(state, req)
        if decoded.token_ids is None:  # the bytes are relayed; only `input` changes
            body = orjson.dumps({**data, "input": decoded.texts})
    relay = await state.dispatch.open_relay(
        req.model, upstream_path(state, req.model), body, priority=request_priority(request),
        client=request.receive,
    )
    answer = await relay.read()  # closes the relay: the lease goes back
    if relay.status != 200:
        return passthrough_error(relay, answer)
    return Response(answer, media_type="application/json")


def _ollama_error(status: int, body: bytes) -> Response:
    return Response(
        orjson.dumps({"error": upstream_message(body)}), status_code=status,
        media_type="application/json",
    )


def parse_upstream(body: bytes, model: str) -> EmbeddingResult:
    """A backend's OpenAI answer; one that is not is the backend's fault (502)."""
    try:
        return read_openai_response(orjson.loads(body))
    except (orjson.JSONDecodeError, ValueError, TypeError) as exc:
        raise UpstreamError(
            f"backend of '{model}' sent an unreadable embeddings answer: {exc}", model=model
        ) from exc


async def _load_or_unload(state: FrontState, req: EmbeddingRequest) -> None:
    """Ollama loads the model for a request with nothing to embed (unloads it for
    `keep_alive: 0`)."""
    keep_alive_s = keep_alive_seconds(req.keep_alive)
    entry = await state.catalog.resolve(req.model)
    engine = await state.dispatch.route(entry)
    if keep_alive_s == 0:
        await engine.unload(entry.id)
    else:
        await engine.load(entry.id, keep_alive_s)


async def _ollama(
    request: Request, req: EmbeddingRequest
) -> tuple[EmbeddingResult, int, int] | Response:
    """Embed through the backend: (result, load_duration_ns, total_duration_ns), or the error
    response to send."""
    started = time.monotonic_ns()
    state = state_of(request)
    await require_kind(state, req.model, "embedding")
    if req.empty:
        await _load_or_unload(state, req)
        return EmbeddingResult([], 0), 0, time.monotonic_ns() - started
    req = await as_text(state, req)
    relay = await state.dispatch.open_relay(
        req.model, upstream_path(state, req.model), orjson.dumps(openai_body(req)),
        keep_alive_s=keep_alive_seconds(req.keep_alive), priority=request_priority(request),
        client=request.receive,
    )
    load_ns = relay.lease.load_duration_ns
    answer = await relay.read()
    if relay.status != 200:
        return _ollama_error(relay.status, answer)
    return parse_upstream(answer, req.model), load_ns, time.monotonic_ns() - started


async def ollama_embed(request: Request) -> Response:
    req = parse_ollama_embed(await read_json_object(request))
    done = await _ollama(request, req)
    if isinstance(done, Response):
        return done
    result, load_ns, total_ns = done
    out = render_ollama_embed(
        req.model, result, total_duration_ns=total_ns, load_duration_ns=load_ns
    )
    return Response(orjson.dumps(out), media_type="application/json")


async def ollama_embeddings(request: Request) -> Response:
    req = parse_ollama_embeddings(await read_json_object(request))
    done = await _ollama(request, req)
    if isinstance(done, Response):
        return done
    return Response(orjson.dumps(render_ollama_embeddings(done[0])),
                    media_type="application/json")


routes = [
    Route("/v1/embeddings", openai_embeddings, methods=["POST"]),
    Route("/api/embed", ollama_embed, methods=["POST"]),
    Route("/api/embeddings", ollama_embeddings, methods=["POST"]),
]
