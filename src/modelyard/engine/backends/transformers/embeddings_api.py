"""`POST /v1/embeddings` of an in-process embedding model: OpenAI request → embedder → answer.

No torch here: the shapes are modelyard.embeddings_shapes (shared with the front, which turns
Ollama's `/api/embed` and `/api/embeddings` into this one request), and the embedder is anything
with `Embedder.embed`'s signature. The server passes `embeddings_handler(embedder.embed, name)` to
`build_app(embed=…)` and runs it in a worker thread; it raises InvalidParams (a ValueError with
`.param`, InputTooLong included) for a request it refuses, which the server answers with 400.
Token ids reach it only from a model set to `token_ids: model` (the front decodes tiktoken's):
they are the model's own, read back to text with its tokenizer (`Embedder.decode`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from modelyard.embeddings_shapes import (
    MAX_INPUTS,
    EmbeddingRequest,
    EmbeddingResult,
    InputTooLong,
    InvalidParams,
    decode_base64,
    encode_base64,
    openai_body,
    parse_ollama_embed,
    parse_ollama_embeddings,
    parse_openai_request,
    read_openai_response,
    render_ollama_embed,
    render_ollama_embeddings,
    render_openai_response,
)

__all__ = [
    "MAX_INPUTS",
    "DecodeFn",
    "EmbedFn",
    "EmbeddingRequest",
    "EmbeddingResult",
    "InputTooLong",
    "InvalidParams",
    "decode_base64",
    "embeddings_handler",
    "encode_base64",
    "openai_body",
    "openai_embeddings",
    "parse_ollama_embed",
    "parse_ollama_embeddings",
    "parse_openai_request",
    "read_openai_response",
    "render_ollama_embed",
    "render_ollama_embeddings",
    "render_openai_response",
]


class EmbedFn(Protocol):
    """`Embedder.embed`."""

    def __call__(
        self, texts: list[str], *, truncate: bool = True, dimensions: int | None = None
    ) -> EmbeddingResult: ...


DecodeFn = Callable[[list[list[int]]], list[str]]  # `Embedder.decode`


def openai_embeddings(
    embed: EmbedFn, body: object, *, model_name: str, decode: DecodeFn | None = None
) -> dict[str, Any]:
    """Answer one OpenAI embeddings request body (blocking: run it in a worker thread). The
    answer names the model the request named (the client's alias), else `model_name`."""
    req = parse_openai_request(body, require_model=False)
    texts = req.texts
    if req.token_ids is not None:
        if decode is None:
            raise InvalidParams("this model takes text, not token ids, as `input`", "input")
        texts = decode(req.token_ids)
    result = embed(texts, truncate=req.truncate, dimensions=req.dimensions)
    return render_openai_response(
        result, model=req.model or model_name, encoding_format=req.encoding_format
    )


def embeddings_handler(
    embed: EmbedFn, model_name: str, decode: DecodeFn | None = None
) -> Callable[[Any], dict[str, Any]]:
    """The `embed` callable `server.build_app` takes: request body in, response body out."""

    def handle(body: Any) -> dict[str, Any]:
        return openai_embeddings(embed, body, model_name=model_name, decode=decode)

    return handle
