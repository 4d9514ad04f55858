"""GET /openapi.json: the whole HTTP API as one OpenAPI 3.1 document.

Clients are generated from it and the fuzz tier (tests/fuzz) runs schemathesis over it. The
document comes from `OPERATIONS`, a table with one entry per (method, route path) of the app:
request bodies are the pydantic models the handlers validate with (so the document cannot drift
from the validation), errors are the shape of the API family the path belongs to. A route added
to the app without an entry here fails tests/integration/test_openapi.py.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard import __version__
from modelyard.embeddings_shapes import MAX_INPUTS
from modelyard.front.api import (
    accounts,
    admin,
    native,
    ollama,
    ollama_create,
    ollama_models,
    openai,
    pulls,
)
from modelyard.front.api import anthropic as anthropic_api
from modelyard.front.api import batches as batches_api
from modelyard.front.api import cluster as cluster_api
from modelyard.front.api import limits as limits_api
from modelyard.front.api import responses as responses_api
from modelyard.front.archive.store import KINDS, MAX_LIST
from modelyard.front.chat import anthropic_shapes
from modelyard.front.identity.auth import LOGIN_COOKIE, RouteClass, route_class
from modelyard.front.ops.logs import MAX_LIMIT
from modelyard.rerank_shapes import MAX_DOCUMENTS
from modelyard.wire.doctor import DoctorReport

JSON = "application/json"
SSE = "text/event-stream"
NDJSON = "application/x-ndjson"
Schema = dict[str, Any]


# ---- bodies that are parsed by hand (embeddings_shapes, services): their schemas as models ----


class OpenAIEmbeddingRequest(BaseModel):
    """What embeddings_shapes.parse_openai_request accepts."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description=f"text(s), at most {MAX_INPUTS}, none empty; or token ids (one list, or a "
        "list of lists), whose vocabulary the model's `token_ids` setting names"
    )
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(None, ge=1)
    truncate: bool | None = None
    user: str | None = None


class RerankDocument(BaseModel):
    text: str


class RerankRequest(BaseModel):
    """What rerank_shapes.parse_rerank_request accepts (Jina's and Cohere's shape)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    query: str = Field(min_length=1)
    documents: list[str | RerankDocument] = Field(
        min_length=1, max_length=MAX_DOCUMENTS, description="texts to order by relevance"
    )
    top_n: int | None = Field(None, ge=1, description="how many results; null: all")
    return_documents: bool = Field(False, description="echo each result's text in `document`")


class OllamaEmbedRequest(BaseModel):
    """embeddings_shapes.parse_ollama_embed: no input (or "") only loads the model."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]] | None = None
    truncate: bool | None = None
    dimensions: int | None = Field(None, ge=1)
    keep_alive: str | float | None = None
    options: dict[str, Any] | None = None


class OllamaEmbeddingsRequest(BaseModel):
    """embeddings_shapes.parse_ollama_embeddings (the legacy one-text form)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    prompt: str | None = None
    keep_alive: str | float | None = None
    options: dict[str, Any] | None = None


class ServiceRequest(BaseModel):
    """A speech or image request: passed to the service unchanged; `model` picks the service."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, min_length=1)


class Transcription(BaseModel):
    """The multipart form of /v1/audio/transcriptions (passed to the service unchanged)."""

    model_config = ConfigDict(extra="allow")

    file: bytes = Field(json_schema_extra={"format": "binary"})
    model: str | None = None


# ---- the table ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    tag: str
    summary: str
    body: type[BaseModel] | None = None
    body_required: bool = True
    body_media: str = JSON
    query: tuple[tuple[str, Schema], ...] = ()
    answers: tuple[str, ...] = (JSON,)  # media types of a successful answer
    answer: type[BaseModel] | None = None  # the JSON answer's model, where it has one


_STR: Schema = {"type": "string"}
_INT: Schema = {"type": "integer"}
_LOGS_QUERY = (("engine", _STR), ("model", _STR),
               ("after", {"type": "integer", "minimum": 0, "maximum": 2**62}),
               ("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}))
_OWNER = (("owner", _STR),)
_ACTIVITY_QUERY = (("model", _STR), *_OWNER, ("status", _STR), ("api", _STR))
_CHAT_ANSWERS = (JSON, SSE)
_USAGE_QUERY = (("owner", _STR), ("model", _STR), ("start", _STR), ("end", _STR),
                ("group_by", _STR), ("format", {"type": "string", "enum": ["json", "csv"]}))

OPERATIONS: dict[tuple[str, str], Op] = {
    # OpenAI
    ("POST", "/v1/chat/completions"): Op(
        "openai", "Chat completion (JSON, or SSE with stream)", openai.ChatCompletionRequest,
        answers=_CHAT_ANSWERS),
    ("POST", "/v1/completions"): Op(
        "openai", "Text completion (JSON, or SSE with stream)", openai.CompletionRequest,
        answers=_CHAT_ANSWERS),
    ("GET", "/v1/models"): Op("openai", "List the models"),
    # Anthropic Messages
    ("POST", "/v1/messages"): Op(
        "anthropic", "Anthropic Messages (JSON, or Anthropic's SSE events with stream)",
        anthropic_api.MessagesRequest, answers=_CHAT_ANSWERS),
    ("POST", "/v1/messages/count_tokens"): Op(
        "anthropic", "The input tokens of a Messages request", anthropic_api.CountTokensRequest),
    ("GET", "/v1/models/{model:path}"): Op("openai", "One model"),
    ("POST", "/v1/embeddings"): Op("openai", "Embeddings", OpenAIEmbeddingRequest),
    ("POST", "/v1/rerank"): Op("openai", "Rerank documents (Jina/Cohere shape)", RerankRequest),
    ("POST", "/rerank"): Op("openai", "Rerank documents (alias of /v1/rerank)", RerankRequest),
    ("GET", "/v1/sessions"): Op("openai", "The caller's chat sessions"),
    ("DELETE", "/v1/sessions"): Op("openai", "Delete all the caller's chat sessions"),
    ("GET", "/v1/sessions/{session_id}"): Op("openai", "One chat session", query=_OWNER),
    ("DELETE", "/v1/sessions/{session_id}"): Op(
        "openai", "Delete one chat session", query=_OWNER),
    ("POST", "/v1/responses"): Op(
        "openai", "Responses API (JSON, or SSE events with stream)",
        responses_api.ResponsesRequest, answers=_CHAT_ANSWERS),
    ("GET", "/v1/responses/{response_id}"): Op("openai", "One stored response"),
    ("DELETE", "/v1/responses/{response_id}"): Op("openai", "Delete a stored response"),
    ("GET", "/v1/status"): Op("native", "Overview: engines, models, pulls"),
    ("GET", "/v1/usage"): Op(
        "openai", "Token usage per hour/day, user, model, API or token (yours; admins: all)",
        query=_USAGE_QUERY, answers=(JSON, "text/csv")),
    # Batch API (front/api/batches.py)
    ("POST", "/v1/files"): Op("openai", "Upload a batch input (JSONL)", batches_api.FileUpload,
                              body_media="multipart/form-data"),
    ("GET", "/v1/files"): Op("openai", "Your files", query=(
        ("purpose", _STR), ("after", _STR),
        ("limit", {"type": "integer", "minimum": 1, "maximum": batches_api.MAX_LIST}))),
    ("GET", "/v1/files/{file_id}"): Op("openai", "One file"),
    ("DELETE", "/v1/files/{file_id}"): Op("openai", "Delete a file"),
    ("GET", "/v1/files/{file_id}/content"): Op(
        "openai", "A file's bytes", answers=("application/jsonl",)),
    ("POST", "/v1/batches"): Op("openai", "Start a batch", batches_api.BatchRequest),
    ("GET", "/v1/batches"): Op("openai", "Your batches", query=(
        ("after", _STR),
        ("limit", {"type": "integer", "minimum": 1, "maximum": batches_api.MAX_LIST}))),
    ("GET", "/v1/batches/{batch_id}"): Op("openai", "One batch"),
    ("POST", "/v1/batches/{batch_id}/cancel"): Op("openai", "Cancel a batch"),
    # services (bodies go to the service unchanged)
    ("POST", "/v1/audio/speech"): Op(
        "services", "Text to speech", ServiceRequest, answers=("application/octet-stream",)),
    ("POST", "/v1/audio/transcriptions"): Op(
        "services", "Speech to text", Transcription, body_media="multipart/form-data"),
    ("POST", "/v1/images/generations"): Op("services", "Image generation", ServiceRequest),
    # Ollama
    ("POST", "/api/chat"): Op(
        "ollama", "Chat (NDJSON stream unless stream is false)", ollama.ChatRequest,
        answers=(NDJSON, JSON)),
    ("POST", "/api/generate"): Op(
        "ollama", "Generate (NDJSON stream unless stream is false)", ollama.GenerateRequest,
        answers=(NDJSON, JSON)),
    ("POST", "/api/embed"): Op("ollama", "Embeddings", OllamaEmbedRequest),
    ("POST", "/api/embeddings"): Op("ollama", "Embedding (legacy)", OllamaEmbeddingsRequest),
    ("GET", "/api/tags"): Op("ollama", "List the models"),
    ("GET", "/api/ps"): Op("ollama", "Loaded models"),
    ("POST", "/api/show"): Op("ollama", "Model details", ollama_models.ShowRequest),
    ("GET", "/api/version"): Op("ollama", "Ollama API version"),
    ("POST", "/api/pull"): Op(
        "ollama", "Pull a model (NDJSON progress)", pulls.OllamaPullRequest,
        answers=(NDJSON, JSON)),
    ("DELETE", "/api/delete"): Op("ollama", "Delete a model", pulls.NameRequest),
    ("POST", "/api/delete"): Op("ollama", "Delete a model", pulls.NameRequest),
    ("POST", "/api/copy"): Op("ollama", "Copy a model under a new name", pulls.CopyRequest),
    ("POST", "/api/create"): Op(
        "ollama", "Create a preset from a Modelfile (NDJSON status)", ollama_create.CreateRequest,
        answers=(NDJSON, JSON)),
    ("POST", "/api/blobs/{digest}"): Op(
        "ollama", "Upload a file under its sha256 digest (HEAD: is it there)", body=None,
        body_required=False, body_media="application/octet-stream"),
    ("POST", "/api/push"): Op("ollama", "Push a model (not supported: 501)"),
    # native
    ("POST", "/chat"): Op(
        "native", "Chat (JSON, or SSE with stream)", native.NativeChatRequest,
        answers=_CHAT_ANSWERS),
    ("GET", "/models"): Op("native", "The catalog"),
    ("DELETE", "/models/{model:path}"): Op("native", "Delete a pulled model"),
    ("GET", "/health"): Op("native", "Liveness"),
    ("GET", "/status"): Op("native", "Engines and models"),
    ("GET", "/diag"): Op("native", "Diagnostics"),
    ("GET", "/metrics"): Op("native", "Prometheus metrics", answers=("text/plain",)),
    ("GET", "/openapi.json"): Op("native", "This document"),
    ("POST", "/pull"): Op("native", "Start a pull job", pulls.PullRequest),
    ("GET", "/jobs"): Op("native", "Pull jobs"),
    ("GET", "/jobs/{job_id}"): Op("native", "One pull job"),
    ("DELETE", "/jobs/{job_id}"): Op("native", "Cancel a pull job"),
    ("POST", "/jobs/{job_id}/resume"): Op("native", "Resume a pull job"),
    ("GET", "/archive"): Op("archive", "Archived items", query=(
        ("kind", {"type": "string", "enum": list(KINDS)}),
        ("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIST}),
        ("before", {"type": "number"}), *_OWNER)),
    ("GET", "/archive/{id}"): Op("archive", "One archived item"),
    ("DELETE", "/archive/{id}"): Op("archive", "Delete an archived item"),
    ("GET", "/archive/{id}/content"): Op(
        "archive", "An archived item's file", answers=("application/octet-stream",)),
    ("GET", "/activity"): Op("archive", "Recent and in-flight inference requests", query=(
        *_ACTIVITY_QUERY, ("limit", {"type": "integer", "minimum": 1}))),
    ("GET", "/activity/stream"): Op("archive", "Finished requests, live (SSE)",
                                    query=_ACTIVITY_QUERY, answers=(SSE,)),
    # accounts
    ("POST", "/auth/login"): Op("accounts", "Log in (sets the session cookie)", accounts.Login),
    ("GET", "/auth/me"): Op("accounts", "The caller"),
    ("PATCH", "/auth/me"): Op("accounts", "The caller's preferences", accounts.Preferences),
    ("POST", "/auth/logout"): Op("accounts", "Log out"),
    ("POST", "/auth/password"): Op(
        "accounts", "Change the caller's password", accounts.PasswordChange),
    ("GET", "/tokens"): Op("accounts", "API tokens"),
    ("POST", "/tokens"): Op("accounts", "Create an API token", accounts.NewToken),
    ("DELETE", "/tokens/{token_id}"): Op("accounts", "Revoke an API token"),
    # admin
    ("GET", "/admin/users"): Op("admin", "Users"),
    ("POST", "/admin/users"): Op("admin", "Add a user", accounts.NewUser),
    ("DELETE", "/admin/users/{name}"): Op("admin", "Remove a user"),
    ("POST", "/admin/users/{name}/password"): Op(
        "admin", "Reset a user's password", accounts.PasswordReset),
    ("PATCH", "/admin/users/{name}"): Op("admin", "Set a user's group", limits_api.GroupChange),
    ("GET", "/admin/limits"): Op("admin", "Quotas and rate limits, with their counters"),
    ("PUT", "/admin/limits/{subject}"): Op(
        "admin", "Set the limits of a token, user, group or `default`", limits_api.LimitValues),
    ("DELETE", "/admin/limits/{subject}"): Op("admin", "Remove a subject's limits"),
    ("POST", "/admin/models/{model:path}/load"): Op(
        "admin", "Load a model", admin.LoadRequest, body_required=False),
    ("POST", "/admin/models/{model:path}/unload"): Op("admin", "Unload a model"),
    ("GET", "/admin/engines"): Op("admin", "Engines and queues"),
    ("POST", "/admin/reload"): Op("admin", "Reload the config file"),
    ("GET", "/admin/doctor"): Op(
        "admin", "Driver, GPUs, backends' builds and devices, disk and RAM, each problem with "
        "its fix (`modelyard doctor`)", answer=DoctorReport),
    ("POST", "/admin/rescan"): Op("admin", "Rescan the model folders"),
    ("POST", "/admin/import"): Op("admin", "Import a folder's GGUF files", pulls.ImportRequest),
    ("GET", "/admin/logs"): Op("admin", "Log lines", query=_LOGS_QUERY),
    ("GET", "/admin/logs/stream"): Op("admin", "Follow a log (SSE)", query=_LOGS_QUERY,
                                      answers=(SSE,)),
    ("GET", "/admin/cluster"): Op("admin", "The cluster's nodes and their engines"),
    ("POST", "/admin/cluster/drain"): Op(
        "admin", "Drain a node (no new loads) or end its drain", cluster_api.DrainRequest),
    # Web Studio
    ("GET", "/"): Op("studio", "The Web Studio", answers=("text/html",)),
    ("GET", "/login"): Op("studio", "The Web Studio's login page", answers=("text/html",)),
    ("GET", "/studio/assets/{path:path}"): Op("studio", "A Studio file", answers=("*/*",)),
    ("GET", "/studio/events"): Op("studio", "Status feed (SSE)", answers=(SSE,)),
}


# ---- the document ------------------------------------------------------------------------------

_PARAM = re.compile(r"{([^}:]+)(?::[^}]+)?}")
_REF = "#/components/schemas/{model}"


def openapi_path(route_path: str) -> str:
    """Starlette's `/v1/models/{model:path}` as OpenAPI spells it: `/v1/models/{model}`."""
    return _PARAM.sub(r"{\1}", route_path)


def _error_schema(path: str) -> str:
    """The error shape of the API family `path` belongs to (as front/render.py picks it)."""
    if path.startswith(anthropic_shapes.PATH_PREFIX):
        return "AnthropicError"
    if path.startswith("/v1/"):
        return "OpenAIError"
    return "OllamaError" if path.startswith("/api/") else "NativeError"


_ERRORS: dict[str, Schema] = {
    "OpenAIError": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"], "properties": {
            "message": _STR, "type": _STR, "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]}}}}},
    "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                              "properties": {"type": _STR, "message": _STR}}}},
    "OllamaError": {"type": "object", "required": ["error"], "properties": {"error": _STR}},
    "NativeError": {"type": "object", "required": ["error", "message"], "properties": {
        "error": _STR, "message": _STR, "consumer": {"type": ["string", "null"]},
        "retryable": {"type": "boolean"}, "param": _STR, "retry_after_s": {"type": "number"},
        "log_tail": {"type": "array", "items": _STR}}},
}
_PUBLIC_SECURITY: list[dict[str, list[str]]] = []
# A bearer token or the Web Studio's session cookie; `{}`: loopback with auth `auto` or `off`
# needs neither on inference routes (front/identity/auth.py decides).
_SECURITY: list[dict[str, list[str]]] = [{"bearer": []}, {"session": []}]
_OPEN_SECURITY = [*_SECURITY, {}]


def _operation(method: str, path: str, op: Op, bodies: dict[type[BaseModel], Schema],
               answers: dict[type[BaseModel], Schema]) -> Schema:
    params: list[Schema] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in _PARAM.findall(path)
    ]
    params += [{"name": name, "in": "query", "required": False, "schema": schema}
               for name, schema in op.query]
    error = {"$ref": f"#/components/schemas/{_error_schema(path)}"}
    cls = route_class(method, openapi_path(path))
    security = {RouteClass.PUBLIC: _PUBLIC_SECURITY,
                RouteClass.INFERENCE: _OPEN_SECURITY}.get(cls, _SECURITY)
    out: Schema = {
        "operationId": f"{method.lower()}_{re.sub(r'[^a-z0-9]+', '_', path.lower()).strip('_')}",
        "tags": [op.tag],
        "summary": op.summary,
        "x-modelyard-route-class": str(cls),
        "security": security,
        "responses": {
            "200": {"description": "OK", "content": {
                media: {"schema": answers[op.answer]} if op.answer and media == JSON else {}
                for media in op.answers}},
            "default": {"description": "An error, in the API family's shape",
                        "content": {JSON: {"schema": error}}},
        },
    }
    if params:
        out["parameters"] = params
    if op.body is not None:
        out["requestBody"] = {"required": op.body_required,
                              "content": {op.body_media: {"schema": bodies[op.body]}}}
    return out


@functools.cache
def document() -> Schema:
    models = sorted({op.body for op in OPERATIONS.values() if op.body is not None},
                    key=lambda m: m.__qualname__)
    shown = sorted({op.answer for op in OPERATIONS.values() if op.answer is not None},
                   key=lambda m: m.__qualname__)
    refs, defs = models_json_schema(
        [(m, "validation") for m in models] + [(m, "serialization") for m in shown],
        ref_template=_REF)
    bodies = {m: refs[(m, "validation")] for m in models}
    answers = {m: refs[(m, "serialization")] for m in shown}
    paths: dict[str, Schema] = {}
    for (method, path), op in OPERATIONS.items():
        paths.setdefault(openapi_path(path), {})[method.lower()] = _operation(
            method, path, op, bodies, answers)
    return {
        "openapi": "3.1.0",
        "info": {"title": "modelyard", "version": __version__,
                 "description": "OpenAI, Ollama, Anthropic and native APIs over local models."},
        "paths": paths,
        "components": {
            "schemas": {**defs.get("$defs", {}), **_ERRORS},
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer",
                           "description": "An API token (POST /tokens, or the CLI's token)."},
                "session": {"type": "apiKey", "in": "cookie", "name": LOGIN_COOKIE,
                            "description": "The Web Studio's session (POST /auth/login)."},
            },
        },
    }


async def openapi_json(_: Request) -> Response:
    return Response(orjson.dumps(document()), media_type=JSON)


routes = [Route("/openapi.json", openapi_json, methods=["GET"])]
