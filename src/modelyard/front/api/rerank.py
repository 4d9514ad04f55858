"""Rerank: `POST /v1/rerank` and `POST /rerank` (Jina's and Cohere's shape, rerank_shapes.py).

The request is checked before any load (a bad one, or a model that does not rerank, is a 400),
then every document's score is asked of the model's backend at its `/v1/rerank` (llama-server in
`--reranking` mode for a GGUF reranker, the transformers backend for a cross-encoder), and the
answer sorted, cut to `top_n` and given its documents here (so every backend answers alike).
Errors are OpenAI-shaped (the shape Jina's and Cohere's clients read a message from); a
backend's own 4xx/5xx passes through.
"""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard.errors import UpstreamError
from modelyard.front.api.model_kind import require_kind
from modelyard.front.dispatch.relay import passthrough_error
from modelyard.front.state import read_json_object, request_priority, state_of
from modelyard.rerank_shapes import (
    RerankScores,
    backend_body,
    parse_rerank_request,
    read_backend,
    render_rerank,
    sigmoid,
)

PATH = "/v1/rerank"  # what llama-server (--reranking) and the transformers backend serve
# Backends whose scores are a cross-encoder's raw logit: shown through a sigmoid, in (0, 1) as
# Jina's and Cohere's are. Another server's scores (an OpenAI-style one) are passed as it sent them.
RAW_LOGIT_BACKENDS = ("llamacpp", "transformers")


async def rerank(request: Request) -> Response:
    state = state_of(request)
    req = parse_rerank_request(await read_json_object(request))
    await require_kind(state, req.model, "rerank")
    relay = await state.dispatch.open_relay(
        req.model, PATH, orjson.dumps(backend_body(req)), priority=request_priority(request),
        client=request.receive,
    )
    answer = await relay.read()  # closes the relay: the lease goes back
    if relay.status != 200:
        return passthrough_error(relay, answer)
    try:
        scores = read_backend(orjson.loads(answer), len(req.documents))
    except (orjson.JSONDecodeError, ValueError) as exc:
        raise UpstreamError(
            f"backend of '{req.model}' sent an unreadable rerank answer: {exc}", model=req.model
        ) from exc
    entry = state.catalog.registry.get(req.model)
    if entry is not None and entry.spec.backend in RAW_LOGIT_BACKENDS:
        scores = RerankScores([sigmoid(s) for s in scores.scores], scores.prompt_tokens)
    out = render_rerank(req, req.model, scores)
    return Response(orjson.dumps(out), media_type="application/json")


routes = [
    Route("/v1/rerank", rerank, methods=["POST"]),
    Route("/rerank", rerank, methods=["POST"]),
]
