"""OpenAI Responses API: POST /v1/responses (JSON or SSE events), GET and DELETE
/v1/responses/{id} for stored ones.

The request's input items, instructions and function tools become an OpenAI chat body
(front/chat/responses_shapes.py) that runs through the one chat pipeline
(front/chat/pipeline.py), framed by front/chat/render_responses.py. `store` (true by default,
as OpenAI's) and `previous_response_id` are server-side chat sessions
(front/chat/sessions/responses.py): a continuation sends only its new input. Always re-encoded
(never the passthrough): the client's body is not a chat body.
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard.front.api.context import chat_context, context_of
from modelyard.front.chat import pipeline
from modelyard.front.chat.render_responses import ResponsesRender
from modelyard.front.chat.request import CHAT_PATH, ChatCall
from modelyard.front.chat.responses_shapes import (
    chat_tool_choice,
    chat_tools,
    input_messages,
    new_id,
    response_format,
    response_head,
)
from modelyard.front.chat.sessions import responses as stored
from modelyard.front.chat.sessions.store import BODY_FIELD, owner_of
from modelyard.front.chat.shapes import check_openai_chat
from modelyard.front.chat.tools.support import check_tools_for
from modelyard.front.chat.vision import check_vision_for
from modelyard.front.identity.principal import principal_of
from modelyard.front.state import read_json_object, state_of, validate


class ResponsesRequest(BaseModel):
    """The fields modelyard reads; the rest of OpenAI's (`user`, `reasoning`, `truncation`,
    `include`, …) are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    input: Any = Field(description="a string, or a list of input items")
    instructions: str | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, min_length=1)
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    text: dict[str, Any] | None = None


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The upstream chat body: instructions, the `history` the client did not resend, the
    request's input, and the generation options under their chat names."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += [*history, *input_messages(req.input)]
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    options = {"max_tokens": req.max_output_tokens, "temperature": req.temperature,
               "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
               "tools": chat_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice),
               "response_format": response_format(req.text)}
    body.update({k: v for k, v in options.items() if v is not None})
    return body


async def create(request: Request) -> Response:
    state = state_of(request)
    data = await read_json_object(request)
    req = validate(ResponsesRequest, data)
    resp_id = new_id("resp")
    ctx = context_of(request)
    principal = ctx.principal
    sessions = state.chat.sessions
    entry = state.catalog.registry.get(req.model)
    canonical = entry.name if entry is not None else req.model
    if req.previous_response_id is not None:
        await sessions.refresh_all(principal)  # several fronts or workers: stored elsewhere
        cont = stored.continuation(
            sessions, principal, req.previous_response_id, model=canonical,
            instructions=bool(req.instructions), store_new=req.store, new_id=resp_id)
    else:
        cont = stored.Continuation(resp_id if req.store else None, [])
    payload = chat_body(req, cont.history)
    check_openai_chat(payload)
    check_tools_for(state, req.model, payload)
    check_vision_for(state, req.model, payload)

    sid = cont.session_id
    on_final = None
    if sid is not None:
        owner, has_instructions = owner_of(principal), bool(req.instructions)

        def on_final(final: dict[str, Any]) -> None:
            stored.record(sessions, owner, sid, final, instructions=has_instructions)

    head = response_head(resp_id, req.model, data, store=req.store)
    call = ChatCall("openai", "/v1/responses", req.model, CHAT_PATH, req.stream, payload,
                    fields={} if sid is None else {BODY_FIELD: sid}, progress=False)
    return await pipeline.answer(chat_context(request, call, ctx), call,
                                 ResponsesRender(head, on_final))


async def retrieve(request: Request) -> Response:
    sessions, principal = state_of(request).chat.sessions, principal_of(request)
    await sessions.refresh_all(principal)  # several fronts or workers: stored elsewhere
    _, record = stored.find(sessions, principal, request.path_params["response_id"])
    return Response(orjson.dumps(record["response"]), media_type="application/json")


async def delete(request: Request) -> Response:
    resp_id = request.path_params["response_id"]
    sessions, principal = state_of(request).chat.sessions, principal_of(request)
    await sessions.refresh_all(principal)
    stored.delete(sessions, principal, resp_id)
    if sessions.shared:
        await sessions.flush()  # forgotten for the others before the answer says so
    return Response(orjson.dumps({"id": resp_id, "object": "response", "deleted": True}),
                    media_type="application/json")


routes = [
    Route("/v1/responses", create, methods=["POST"]),
    Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
]
