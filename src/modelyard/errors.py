"""The one error tree of modelyard, and how each API renders it (DESIGN.md §3.8).

    ModelyardError                  500 internal_error
    ├── InvalidRequest              400 invalid_request      (names the offending field in `param`)
    ├── ToolsUnsupported            400 tools_unsupported    (`tools` for a model without tools)
    ├── ToolTypeUnsupported         400 tool_type_unsupported (a tool type modelyard does not run)
    ├── ModelfileInvalid            400 modelfile_invalid    (/api/create: names the line)
    ├── NumCtxTooLarge              400 num_ctx_too_large    (over the model's trained context)
    ├── NumCtxNotAllowed            403 num_ctx_not_allowed  (over the caller's `max_num_ctx`)
    ├── ContextVariantsFull         429 context_variants_full (`max_context_variants` running)
    ├── VisionUnsupported           400 vision_unsupported   (images for a model that reads none)
    ├── ContentTypeUnsupported      400 content_type_unsupported (audio/file parts it cannot read)
    ├── WrongModelKind              400 model_not_embedding / model_not_reranker (names one that is)
    ├── ModelNotFound               404 model_not_found
    │   └── NoServiceFor            404 model_not_found      (an audio/image route nothing serves)
    ├── ModelNotPulled              404 model_not_pulled     (says the pull command)
    ├── PullNameUnknown             404 pull_name_unknown    (a plain /api/pull name: the Hub form)
    ├── JobNotFound                 404 job_not_found
    ├── RouteNotFound               404 not_found            (no such endpoint)
    ├── ArchiveItemNotFound         404 archive_item_not_found (or not yours)
    ├── SessionNotFound             404 session_not_found    (no such chat session, or not yours)
    ├── Unauthorized                401 unauthorized         (no or bad credentials)
    ├── Forbidden                   403 forbidden            (credentials lack the scope/role)
    ├── PasswordChangeRequired      403 password_change_required (first login: change it first)
    ├── CsrfFailed                  403 csrf_failed          (cookie request without X-CSRF-Token)
    ├── OriginNotAllowed            403 origin_not_allowed   (a browser request from another site)
    ├── UnsupportedMediaType        415 unsupported_media_type (login/cookie body not JSON)
    ├── TooManyAttempts             429 too_many_attempts    (failed logins; with Retry-After)
    ├── HostNotAllowed              421 host_not_allowed     (Host header is not the bound name)
    ├── PayloadTooLarge             413 payload_too_large    (body over max_body_bytes)
    ├── UnsupportedMediaType        415 unsupported_media_type (a body that is not JSON)
    ├── Conflict                    409 conflict             (e.g. the user exists already)
    ├── MethodNotAllowed            405 method_not_allowed
    ├── BackendUnavailable          503 backend_unavailable  (e.g. no llama-server binary)
    ├── ModelLoadFailed             503 model_load_failed    (carries the child's last log lines)
    │   └── ModelPullFailed         503 model_pull_failed    (pulling it onto the engine's node)
    ├── EngineUnavailable           503 engine_unavailable   (with Retry-After)
    ├── InsufficientMemory          503 insufficient_memory  (no eviction can make room; why)
    ├── EngineCooling               503 engine_cooling       (thermal pause outlasted the wait)
    ├── QueueFull                   429 queue_full           (with Retry-After)
    ├── RateLimited                 429 rate_limited         (over a limit; X-RateLimit-*)
    ├── QueueTimeout                503 queue_timeout        (waited in a model's queue too long)
    ├── ServerShuttingDown          503 shutting_down        (did not finish within the grace)
    ├── ClientClosedRequest         499 client_closed_request (left while waiting)
    │   └── ClientDisconnected      499 client_disconnected  (left before its body was sent)
    └── UpstreamError               502 upstream_error       (a backend broke the protocol)

Every leaf has an HTTP status and a string `code`; engines send errors to the front in the native
shape and the front rebuilds the same class from `code`, so a client sees one error whichever
process raised it.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar


class ModelyardError(Exception):
    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal_error"
    openai_type: ClassVar[str] = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        model: str | None = None,
        retry_after_s: float | None = None,
        log_tail: list[str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.model = model
        self.retry_after_s = retry_after_s
        self.log_tail = log_tail or []

    @property
    def retryable(self) -> bool:
        return self.retry_after_s is not None

    def full_message(self) -> str:
        if not self.log_tail:
            return self.message
        return self.message + "\nlast log lines:\n" + "\n".join(self.log_tail)

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after_s)))}

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.full_message(),
                "type": self.openai_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def ollama_body(self) -> dict[str, Any]:
        return {"error": self.full_message()}

    def native_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "error": self.code,
            "message": self.message,
            "consumer": self.model,
            "retryable": self.retryable,
        }
        if self.param is not None:
            body["param"] = self.param
        if self.retry_after_s is not None:
            body["retry_after_s"] = self.retry_after_s
        if self.log_tail:
            body["log_tail"] = self.log_tail
        return body


class InvalidRequest(ModelyardError):
    status = 400
    code = "invalid_request"
    openai_type = "invalid_request_error"


class NotImplementedHere(ModelyardError):
    """A route of a peer's API that modelyard deliberately does not serve (Ollama's /api/push)."""

    status = 501
    code = "not_implemented"


class ToolsUnsupported(ModelyardError):
    status = 400
    code = "tools_unsupported"
    openai_type = "invalid_request_error"

    def __init__(self, model: str, message: str | None = None, **kw: Any) -> None:
        kw.setdefault("param", "tools")
        super().__init__(
            message
            or f"model '{model}' cannot call tools; drop `tools`, or set `tools: true` on the "
            "model in the config if its backend can",
            model=model,
            **kw,
        )


class ModelNotFound(ModelyardError):
    status = 404
    code = "model_not_found"
    openai_type = "invalid_request_error"

    def __init__(self, model: str, hint: str = "") -> None:
        super().__init__(
            f"model '{model}' not found; `modelyard ls` lists the models this server knows"
            + (f"; {hint}" if hint else ""),
            param="model",
            model=model,
        )


class ModelNotPulled(ModelyardError):
    status = 404
    code = "model_not_pulled"
    openai_type = "invalid_request_error"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"model '{model}' is not on this machine; pull it first: `modelyard pull {model}` "
            f"(or POST /pull {{\"model\": \"{model}\"}})",
            param="model",
            model=model,
        )


class JobNotFound(ModelyardError):
    status = 404
    code = "job_not_found"

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no pull job {job_id!r}; GET /jobs lists them")


class NodeNotFound(ModelyardError):
    status = 404
    code = "node_not_found"

    def __init__(self, host: str) -> None:
        super().__init__(f"no node {host!r} in this cluster; `modelyard cluster status` lists "
                         "them")


class ArchiveItemNotFound(ModelyardError):
    status = 404
    code = "archive_item_not_found"

    def __init__(self, item_id: str) -> None:
        super().__init__(f"no archive item {item_id!r} (or it is not yours); GET /archive lists "
                         "yours")


class SessionNotFound(ModelyardError):
    status = 404
    code = "session_not_found"
    openai_type = "invalid_request_error"

    @classmethod
    def for_id(cls, session_id: str) -> SessionNotFound:
        return cls(f"no chat session {session_id!r} (or it is not yours, or it expired); "
                   "GET /v1/sessions lists yours", param="session_id")


class Unauthorized(ModelyardError):
    status = 401
    code = "unauthorized"
    openai_type = "authentication_error"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="modelyard"'}


class Forbidden(ModelyardError):
    status = 403
    code = "forbidden"
    openai_type = "permission_error"


class PasswordChangeRequired(Forbidden):
    code = "password_change_required"


class CsrfFailed(Forbidden):
    code = "csrf_failed"


class HostNotAllowed(ModelyardError):
    status = 421
    code = "host_not_allowed"
    openai_type = "invalid_request_error"


class PayloadTooLarge(ModelyardError):
    status = 413
    code = "payload_too_large"
    openai_type = "invalid_request_error"


class UnsupportedMediaType(ModelyardError):
    """415: a body that is not JSON where only JSON is taken (the login, cookie requests, an
    engine's internal API): a web page can post text/plain or a form without a preflight."""

    status = 415
    code = "unsupported_media_type"
    openai_type = "invalid_request_error"


class Conflict(ModelyardError):
    status = 409
    code = "conflict"
    openai_type = "invalid_request_error"


class RouteNotFound(ModelyardError):
    status = 404
    code = "not_found"
    openai_type = "invalid_request_error"


class MethodNotAllowed(ModelyardError):
    status = 405
    code = "method_not_allowed"
    openai_type = "invalid_request_error"


class BackendUnavailable(ModelyardError):
    status = 503
    code = "backend_unavailable"


class ModelLoadFailed(ModelyardError):
    status = 503
    code = "model_load_failed"


class ModelPullFailed(ModelLoadFailed):
    """Pulling a model's files onto the engine's node failed (engine/node_pull.py): the pull's
    code and message. A load failure: the model cools down before the next try."""

    code = "model_pull_failed"


class ModelFilesMissing(ModelyardError):
    """The engine's node does not have the model's files (no shared storage with the front,
    and not pulled there): the front routes to engines that have them first."""

    status = 503
    code = "model_files_missing"


class EngineUnavailable(ModelyardError):
    status = 503
    code = "engine_unavailable"


class EngineProtocolMismatch(ModelyardError):
    """The engine speaks another version of the engine protocol (wire/lease.py PROTOCOL) than
    the front: the front does not attach to it, and it stays down."""

    status = 503
    code = "engine_protocol_mismatch"


class InsufficientMemory(ModelyardError):
    status = 503
    code = "insufficient_memory"


class EngineCooling(ModelyardError):
    status = 503
    code = "engine_cooling"


class QueueFull(ModelyardError):
    status = 429
    code = "queue_full"
    openai_type = "rate_limit_error"


class QueueTimeout(ModelyardError):
    status = 503
    code = "queue_timeout"


class ServerShuttingDown(ModelyardError):
    status = 503
    code = "shutting_down"


class ClientClosedRequest(ModelyardError):
    status = 499
    code = "client_closed_request"


class UpstreamError(ModelyardError):
    status = 502
    code = "upstream_error"


class PullNameUnknown(ModelyardError):
    """Ollama's /api/pull of a plain name (no organisation) that is neither a model here nor
    in the table of library names (store/ollama_library.py, `pull_aliases`)."""

    status = 404
    code = "pull_name_unknown"
    openai_type = "invalid_request_error"

    def __init__(self, name: str) -> None:
        super().__init__(
            f"'{name}' is not a model here nor a known library name, and modelyard pulls from "
            "Hugging Face: pull hf.co/<org>/<repo>[:quant] (e.g. "
            "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M), or map the name in the "
            "`pull_aliases` setting", param="model", model=name)


_BY_CODE: dict[str, type[ModelyardError]] = {
    cls.code: cls
    for cls in (
        ModelyardError,
        InvalidRequest,
        ToolsUnsupported,
        ModelNotFound,
        ModelNotPulled,
        JobNotFound,
        PullNameUnknown,
        SessionNotFound,
        RouteNotFound,
        MethodNotAllowed,
        BackendUnavailable,
        ModelLoadFailed,
        ModelPullFailed,
        ModelFilesMissing,
        EngineUnavailable,
        InsufficientMemory,
        EngineCooling,
        QueueFull,
        QueueTimeout,
        ServerShuttingDown,
        ClientClosedRequest,
        UpstreamError,
    )
}


def from_native_body(body: dict[str, Any]) -> ModelyardError:
    """Rebuild the error an engine raised from its native-shape body."""
    cls = _BY_CODE.get(str(body.get("error")), ModelyardError)
    model = body.get("consumer")
    if cls in (ModelNotFound, ModelNotPulled):
        return cls(str(model))
    if cls is ToolsUnsupported:
        return ToolsUnsupported(str(model), str(body.get("message", "")) or None)
    return cls(
        str(body.get("message", "engine error")),
        param=body.get("param"),
        model=model,
        retry_after_s=body.get("retry_after_s"),
        log_tail=list(body.get("log_tail") or []),
    )


class VisionUnsupported(ModelyardError):
    status = 400
    code = "vision_unsupported"
    openai_type = "invalid_request_error"

    @classmethod
    def for_model(cls, model: str) -> VisionUnsupported:
        return cls(
            f"model '{model}' cannot read images; drop the image parts (`image_url`, Ollama's "
            "`images`), use a vision model (a GGUF with its mmproj projector), or set `vision: "
            "true` on the model in the config if its backend can",
            param="messages", model=model)


class ClientDisconnected(ClientClosedRequest):
    """The client closed the connection before its request body had all arrived (starlette's
    ClientDisconnect): its own doing, so a 499 nobody receives, not a 500 with a traceback."""

    code = "client_disconnected"


class WrongModelKind(ModelyardError):
    """A model asked for what it does not serve: embeddings of a chat model, a rerank of an
    embedding model. The message names models that do."""

    status = 400
    code = "model_wrong_kind"
    openai_type = "invalid_request_error"
    # What each route needs, and the word for it in a message.
    _NEEDS: ClassVar[dict[str, str]] = {"embedding": "embeddings", "rerank": "reranking"}

    @classmethod
    def for_model(cls, model: str, kind: str | None, needs: str,
                  candidates: list[str]) -> WrongModelKind:
        what = cls._NEEDS.get(needs, needs)
        sub = ModelNotEmbedding if needs == "embedding" else ModelNotReranker
        suggest = (f"; use {', '.join(repr(c) for c in candidates[:5])}" if candidates
                   else f"; no model here serves {what}")
        return sub(f"model '{model}' is a {kind or 'model'} model and does not serve {what}"
                   + suggest, param="model", model=model)


class ModelNotEmbedding(WrongModelKind):
    code = "model_not_embedding"


class ModelNotReranker(WrongModelKind):
    code = "model_not_reranker"


_BY_CODE.update({cls.code: cls for cls in (VisionUnsupported, ClientDisconnected,
                                           ModelNotEmbedding, ModelNotReranker)})


# ---- added by wave 2 · 1/7 (hardening); kept at the end of the file to ease merging ----------


class TooManyAttempts(ModelyardError):
    """429 too_many_attempts: failed logins for this user or address, with Retry-After."""

    status = 429
    code = "too_many_attempts"
    openai_type = "rate_limit_error"


class OriginNotAllowed(Forbidden):
    """403 origin_not_allowed: a browser request sent from another site's page."""

    code = "origin_not_allowed"


class HeaderFieldsTooLarge(ModelyardError):
    """431: the request head is over `max_header_bytes` or has over `max_header_count` fields."""

    status = 431
    code = "header_fields_too_large"
    openai_type = "invalid_request_error"


class RequestTimeout(ModelyardError):
    """408: the client sent its request head or body too slowly (`header_read_timeout_s`,
    `body_read_timeout_s`)."""

    status = 408
    code = "request_timeout"
    openai_type = "invalid_request_error"


class InsufficientStorage(ModelyardError):
    """507: the disk holding the database (or the data directory) is full."""

    status = 507
    code = "insufficient_storage"


class ClusterOff(ModelyardError):
    """A cluster operation asked of a front that serves this machine only (`cluster.mode: off`):
    the caller's mistake, so a 409, not a 5xx."""

    status = 409
    code = "cluster_off"

    def __init__(self) -> None:
        super().__init__("this server is not a cluster front (cluster.mode: off); start it with "
                         "`modelyard serve --cluster ray` (docs/cluster.md)")


# ---- added by wave 2 · 7/7 (teams: quotas and rate limits, front/identity/limits.py) ---------


class RateLimited(ModelyardError):
    """429 rate_limited: a token, user or group is over its requests per minute, tokens per day
    or concurrent requests. Carries Retry-After and the X-RateLimit-* headers of the limit that
    refused it."""

    status = 429
    code = "rate_limited"
    openai_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: float, limit: int, remaining: int,
                 reset_s: float) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.limit = limit
        self.remaining = remaining
        self.reset_s = reset_s

    def headers(self) -> dict[str, str]:
        return {**super().headers(), **rate_limit_headers(self.limit, self.remaining,
                                                          self.reset_s)}


def rate_limit_headers(limit: int, remaining: int, reset_s: float) -> dict[str, str]:
    """`X-RateLimit-Reset` is in seconds from now (rounded up), as Retry-After is."""
    return {"X-RateLimit-Limit": str(limit), "X-RateLimit-Remaining": str(max(0, remaining)),
            "X-RateLimit-Reset": str(max(0, math.ceil(reset_s)))}



# ---- added by issue 31 (client mistakes that were 5xx; context variants on request) ----------


class ToolTypeUnsupported(InvalidRequest):
    """A `tools` entry of a type modelyard does not run (`web_search`, `file_search`, an
    Anthropic server tool, …): refused before anything is relayed, since a backend answers it
    with a 500."""

    code = "tool_type_unsupported"


class ModelfileInvalid(InvalidRequest):
    """/api/create: a Modelfile line modelyard cannot read; the message names the line."""

    code = "modelfile_invalid"


class NumCtxTooLarge(InvalidRequest):
    """Ollama's `num_ctx` over what the model was trained for (or over the bound when the file
    does not say): no server could honour it."""

    code = "num_ctx_too_large"


class NumCtxNotAllowed(Forbidden):
    """Ollama's `num_ctx` over the model's served context and over the caller's `max_num_ctx`
    limit: a larger context starts a server of its own, which the limits ration."""

    code = "num_ctx_not_allowed"


class ContextVariantsFull(ModelyardError):
    """Ollama's `num_ctx` would start another context variant of a model that already runs
    `max_context_variants` of them, none large enough: retry when one unloads."""

    status = 429
    code = "context_variants_full"
    openai_type = "rate_limit_error"


class PromptTooLongForScoring(InvalidRequest):
    """/v1/completions with `echo` and `logprobs` (prompt scoring) on a backend that scores a
    prompt one token per step (llama-server): a prompt over `max_scored_prompt_tokens`."""

    code = "prompt_too_long_for_scoring"


class PromptLogprobsUnsupported(InvalidRequest):
    """/v1/completions with `echo` and `logprobs` on a model whose backend cannot say the
    prompt's log probabilities."""

    code = "prompt_logprobs_unsupported"


_BY_CODE.update({cls.code: cls for cls in (ToolTypeUnsupported, ModelfileInvalid, NumCtxTooLarge,
                                           NumCtxNotAllowed, ContextVariantsFull,
                                           PromptTooLongForScoring, PromptLogprobsUnsupported)})


# ---- added by issue 32 (the last compatibility gaps: error shapes) ---------------------------


class NoServiceFor(ModelNotFound):
    """An image or audio route (/v1/images/generations, /v1/audio/speech, …) that no model or
    service serves: a 404 `model_not_found`, as OpenAI answers a model it does not have."""

    def __init__(self, route: str, kind: str) -> None:
        ModelyardError.__init__(
            self, f"no model or service serves {route}: register a `service` model that "
            f"declares `{kind}` in its `paths` (docs/scheduling.md, Services)", param="model")


class ContentTypeUnsupported(InvalidRequest):
    """A chat content part the model cannot read (`input_audio`, `file`): llama-server answers
    audio with a 500, which clients retry, and a file part in its own error shape."""

    code = "content_type_unsupported"


_BY_CODE.update({ContentTypeUnsupported.code: ContentTypeUnsupported})
