"""The one request type of the chat pipeline (front/chat/pipeline.py).

Each chat API (OpenAI, Ollama, native) parses its body into a ChatCall: what to send upstream
in the OpenAI shape llama-server serves, and what the pipeline needs to know around it (stream,
keep-alive, the body's own fields). Who asks, at what priority, in which session, archived or
not, is the request's context (front/request_context.py), decided with it. From there on the APIs
share one path; only the rendering of the answer (front/chat/render.py) is the API's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from modelyard.front.chat.ollama_fit import Fit
    from modelyard.front.chat.openai_compat import Reshape

CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATH = "/v1/completions"

Api = Literal["openai", "ollama", "native", "anthropic"]


@dataclass(slots=True)
class ChatCall:
    """One chat or completion request, parsed and validated by its API."""

    api: Api
    endpoint: str  # the route the client called (archived with the transcript)
    model: str  # as the client named it (an alias stays an alias in the answer)
    path: str  # the upstream route: CHAT_PATH or COMPLETION_PATH
    stream: bool
    # The upstream request in the OpenAI shape, without modelyard's `archive` field.
    payload: dict[str, Any]
    # The client's own bytes when they can go upstream unchanged (the OpenAI passthrough, the
    # hot path: never re-encoded); None: `payload` is encoded.
    body: bytes | None = None
    # The request's own fields, where `session_id` (and the tool loop's archive ask) are read.
    fields: dict[str, Any] | None = None
    archive: object = None  # the `archive` field's value (front/archive/capture.py)
    keep_alive_s: float | None = None  # None: the configured default
    # A conversation: it may run in a server-side session and use the MCP tool loop. False
    # (text completions, Ollama's /api/generate): a `session_id` field is refused.
    chat: bool = True
    progress: bool = True  # swap progress may be streamed (the API has a place for it)
    # OpenAI fidelity the backend's answer needs on its way out (front/chat/openai_compat.py);
    # None: the answer passes unchanged.
    reshape: Reshape | None = None
    # The name the relay leases when it is not `model`: a context variant (`<model>@ctx<N>`,
    # front/chat/context.py) for a request that needs a larger context.
    serve_as: str | None = None
    # Ollama's `context` (front/chat/ollama_context.py): the token ids before the answer, which
    # the final chunk carries with the answer's; None: the answer has no `context`.
    context_prefix: list[int] | None = None
    # Ollama's cut of a prompt longer than the context (front/chat/ollama_fit.py): called with
    # the request sent and the backend's counts, it answers a shorter one (None: it cannot).
    # None: an overflow is the backend's 400.
    fit: Fit | None = None

    @property
    def own_fields(self) -> dict[str, Any]:
        return self.payload if self.fields is None else self.fields
