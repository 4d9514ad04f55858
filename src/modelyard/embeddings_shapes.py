"""Embedding requests and responses, in OpenAI's and Ollama's shapes: pure, no torch.

Both sides of the relay use these functions, which is why they live outside the front and outside
the transformers backend (whose package may import torch; the front must not, DESIGN.md §1):

- the front parses a request before it leases a model (a bad request is a 400 without a load)
  and translates Ollama's `/api/embed` and `/api/embeddings` to OpenAI's `/v1/embeddings`, which
  every backend speaks, and the answer back;
- the transformers backend parses the OpenAI request it is sent and renders OpenAI's answer.

OpenAI `POST /v1/embeddings`:
    {"model", "input": str | [str], "encoding_format": "float" | "base64", "dimensions", "user",
     "truncate": bool (modelyard's extension, default true)}
    → {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
       "usage": {"prompt_tokens", "total_tokens"}}
  `base64` is the vector's little-endian float32 bytes, as OpenAI sends them. `input` may also
  be token ids, `[int]` (one input) or `[[int]]`, as LangChain's `OpenAIEmbeddings` sends by
  default: they are parsed into `token_ids`, and the front reads them back into text by the
  model's `token_ids` setting (front/api/token_ids.py) or passes them on.
Ollama `POST /api/embed`:
    {"model", "input": str | [str] (or token ids, as OpenAI's), "truncate": true, "dimensions",
     "keep_alive", "options"}
    → {"model", "embeddings": [[...]], "total_duration", "load_duration", "prompt_eval_count"}
Ollama `POST /api/embeddings` (legacy): {"model", "prompt"} → {"embedding": [...]}
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass, field
from typing import Any, Literal

from modelyard.errors import InvalidRequest

MAX_INPUTS = 2048  # OpenAI's limit on the items of one request

EncodingFormat = Literal["float", "base64"]


class InvalidParams(InvalidRequest, ValueError):
    """A request the embeddings API refuses: HTTP 400, naming the offending field in `param`.

    It is both a ValueError (for code that knows nothing of modelyard's errors) and an
    InvalidRequest, so the front renders it in the shape of the API that was called."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param=param)


class InputTooLong(InvalidParams):
    """An input longer than the model takes, in a request that asked not to truncate."""

    def __init__(self, index: int, tokens: int, limit: int) -> None:
        super().__init__(
            f"input[{index}] is {tokens} tokens long, more than this model's limit of {limit} "
            "tokens (send `truncate: true` to cut it to the limit)",
            param="input",
        )
        self.index = index
        self.tokens = tokens
        self.limit = limit


@dataclass(frozen=True)
class EmbeddingResult:
    """One vector per text, in the order of the texts, and the tokens they took."""

    vectors: list[list[float]]
    prompt_tokens: int


@dataclass(frozen=True)
class EmbeddingRequest:
    """What an embeddings request asks, whichever API it came through."""

    model: str
    texts: list[str]  # empty when `input` was token ids
    truncate: bool = True
    dimensions: int | None = None
    encoding_format: EncodingFormat = "float"
    user: str | None = None
    keep_alive: str | int | float | None = None  # Ollama's, parsed by the front
    options: dict[str, Any] = field(default_factory=dict)  # Ollama's; none applies to embeddings
    # `input` as token ids, one list per input (whose ids: the model's `token_ids` setting)
    token_ids: list[list[int]] | None = None

    @property
    def empty(self) -> bool:
        """Nothing to embed (Ollama: a request that only loads the model)."""
        return not self.texts and not self.token_ids


# ---- validation helpers ------------------------------------------------------------------------


def _object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidParams("request body must be a JSON object")
    return body


def _model(body: dict[str, Any], *, required: bool) -> str:
    model = body.get("model")
    if model is None and not required:
        return ""
    if not isinstance(model, str) or not model:
        raise InvalidParams("`model` is required (a non-empty string)", "model")
    return model


def _dimensions(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParams(f"`dimensions` must be an integer, not {value!r}", "dimensions")
    if value < 1:
        raise InvalidParams(f"`dimensions` must be at least 1, not {value}", "dimensions")
    return value


def _bool(value: object, name: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidParams(f"`{name}` must be true or false, not {value!r}", name)
    return value


def _is_token_id(item: object) -> bool:
    return isinstance(item, int) and not isinstance(item, bool)


def _token_ids(items: list[object]) -> list[list[int]]:
    """`input` as token ids: `[int]` (one input) or `[[int]]`, every list non-empty and every
    id an integer >= 0. Whose ids they are (their vocabulary) is for the caller to check."""
    nested = not _is_token_id(items[0])
    rows = items if nested else [items]
    out: list[list[int]] = []
    for i, row in enumerate(rows):
        where = f"input[{i}]" if nested else "input"
        if not isinstance(row, list):
            raise InvalidParams(
                f"{where} must be a list of token ids, as input[0] is, not {type(row).__name__}",
                "input",
            )
        if not row:
            raise InvalidParams(f"{where} must not be an empty list of token ids", "input")
        for j, token in enumerate(row):
            if not _is_token_id(token) or token < 0:
                shown = token if _is_token_id(token) else type(token).__name__
                raise InvalidParams(
                    f"{where}[{j}] must be a token id (an integer >= 0), not {shown}", "input"
                )
        out.append(row)
    return out


def _input(value: object, *, empty_ok: bool) -> tuple[list[str], list[list[int]] | None]:
    """`input`: a string or a list of strings, at most MAX_INPUTS, none empty; or token ids
    (`[int]`, `[[int]]`, at most MAX_INPUTS lists). Returns (texts, token ids or None)."""
    if isinstance(value, str):
        items: list[object] = [value]
    elif isinstance(value, list):
        items = value
    elif value is None:
        if empty_ok:
            return [], None
        raise InvalidParams("`input` is required: a string or a list of strings", "input")
    else:
        raise InvalidParams(
            f"`input` must be a string or a list of strings, not {type(value).__name__}", "input"
        )
    if not items:
        if empty_ok:
            return [], None
        raise InvalidParams("`input` must not be empty", "input")
    token_ids = None
    if _is_token_id(items[0]) or isinstance(items[0], list):
        token_ids = _token_ids(items)
    count = len(token_ids) if token_ids is not None else len(items)
    if count > MAX_INPUTS:
        raise InvalidParams(
            f"`input` has {count} items; at most {MAX_INPUTS} are allowed per request", "input"
        )
    if token_ids is not None:
        return [], token_ids
    texts: list[str] = []
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise InvalidParams(
                f"input[{i}] must be a string, not {type(item).__name__}", f"input[{i}]"
            )
        if not item:
            if empty_ok and isinstance(value, str):
                return [], None  # Ollama: an empty string asks for a load, not an embedding
            where = "input" if isinstance(value, str) else f"input[{i}]"
            raise InvalidParams(f"{where} must not be an empty string", where)
        texts.append(item)
    return texts, None


# ---- OpenAI ------------------------------------------------------------------------------------


def parse_openai_request(body: object, *, require_model: bool = True) -> EmbeddingRequest:
    """An OpenAI `POST /v1/embeddings` body; raises InvalidParams for a bad one."""
    data = _object(body)
    model = _model(data, required=require_model)
    texts, token_ids = _input(data.get("input"), empty_ok=False)
    raw_format = data.get("encoding_format")
    fmt: EncodingFormat
    if raw_format is None or raw_format == "float":
        fmt = "float"
    elif raw_format == "base64":
        fmt = "base64"
    else:
        raise InvalidParams(
            f"`encoding_format` must be \"float\" or \"base64\", not {raw_format!r}",
            "encoding_format",
        )
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidParams("`user` must be a string", "user")
    return EmbeddingRequest(
        model=model,
        texts=texts,
        truncate=_bool(data.get("truncate"), "truncate", True),
        dimensions=_dimensions(data.get("dimensions")),
        encoding_format=fmt,
        user=user,
        token_ids=token_ids,
    )


def encode_base64(vector: list[float]) -> str:
    """OpenAI's base64 embedding: the little-endian float32 bytes of the vector."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def decode_base64(text: str) -> list[float]:
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 4:
        raise ValueError(f"a base64 embedding of {len(raw)} bytes is not float32s")
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def render_openai_response(
    result: EmbeddingResult, *, model: str, encoding_format: EncodingFormat = "float"
) -> dict[str, Any]:
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": encode_base64(v) if encoding_format == "base64" else v,
        }
        for i, v in enumerate(result.vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }


def read_openai_response(body: object) -> EmbeddingResult:
    """The vectors (in input order, base64 decoded) and token count of an OpenAI answer."""
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        raise ValueError("not an OpenAI embeddings response (no `data` list)")
    items = sorted(body["data"], key=lambda d: int(d.get("index", 0)))
    vectors: list[list[float]] = []
    for item in items:
        vector = item.get("embedding") if isinstance(item, dict) else None
        if isinstance(vector, str):
            vectors.append(decode_base64(vector))
        elif isinstance(vector, list):
            vectors.append([float(x) for x in vector])
        else:
            raise ValueError("an embeddings response item has no `embedding`")
    usage = body.get("usage")
    tokens = usage.get("prompt_tokens", 0) if isinstance(usage, dict) else 0
    return EmbeddingResult(vectors, int(tokens or 0))


# ---- Ollama ------------------------------------------------------------------------------------


def _ollama_common(data: dict[str, Any]) -> tuple[str, str | int | float | None, dict[str, Any]]:
    model = _model(data, required=True)
    keep_alive = data.get("keep_alive")
    if keep_alive is not None and (
        isinstance(keep_alive, bool) or not isinstance(keep_alive, str | int | float)
    ):
        raise InvalidParams("`keep_alive` must be a duration (\"5m\") or seconds", "keep_alive")
    options = data.get("options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise InvalidParams("`options` must be an object", "options")
    return model, keep_alive, options


def parse_ollama_embed(body: object) -> EmbeddingRequest:
    """Ollama `POST /api/embed`. No input (or "") is valid: Ollama then only loads the model."""
    data = _object(body)
    model, keep_alive, options = _ollama_common(data)
    texts, token_ids = _input(data.get("input"), empty_ok=True)
    return EmbeddingRequest(
        model=model,
        texts=texts,
        truncate=_bool(data.get("truncate"), "truncate", True),
        dimensions=_dimensions(data.get("dimensions")),
        keep_alive=keep_alive,
        options=options,
        token_ids=token_ids,
    )


def parse_ollama_embeddings(body: object) -> EmbeddingRequest:
    """Ollama's legacy `POST /api/embeddings` (`prompt`, one text; "" only loads the model)."""
    data = _object(body)
    model, keep_alive, options = _ollama_common(data)
    prompt = data.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidParams("`prompt` must be a string", "prompt")
    return EmbeddingRequest(
        model=model, texts=[prompt] if prompt else [], keep_alive=keep_alive, options=options
    )


def openai_body(req: EmbeddingRequest) -> dict[str, Any]:
    """The OpenAI `/v1/embeddings` request a backend is sent for `req` (from any API)."""
    body: dict[str, Any] = {
        "model": req.model,
        "input": req.texts if req.token_ids is None else req.token_ids,
        "encoding_format": "float",
        "truncate": req.truncate,
    }
    if req.dimensions is not None:
        body["dimensions"] = req.dimensions
    return body


def render_ollama_embed(
    model: str,
    result: EmbeddingResult,
    *,
    total_duration_ns: int = 0,
    load_duration_ns: int = 0,
) -> dict[str, Any]:
    return {
        "model": model,
        "embeddings": result.vectors,
        "total_duration": total_duration_ns,
        "load_duration": load_duration_ns,
        "prompt_eval_count": result.prompt_tokens,
    }


def render_ollama_embeddings(result: EmbeddingResult) -> dict[str, Any]:
    """The legacy answer: the one vector (empty when nothing was embedded)."""
    return {"embedding": result.vectors[0] if result.vectors else []}
