"""The one chat pipeline: every chat and completion route (OpenAI, Ollama, native, Anthropic,
Responses) runs its parsed request (front/chat/request.py) through here with the request's
context (front/request_context.py: the caller, priority, session, archive plan and the client's
receive channel, decided once by the API layer; no web framework request below it), and only
frames the answer its own way (front/chat/render.py).

In order: the MCP tool loop (when the chat opts in: front/chat/tools/http.py), the server-side
session (its history spliced in, the turn committed as the answer passes:
front/chat/sessions/relay.py), the archive capture (when its context plans one:
front/archive/capture.py), the lease
and the relay (state.dispatch.open_relay; swap progress while a model loads:
front/dispatch/swap_progress.py), then the answer, streamed or whole.

Rules it keeps (DESIGN.md §3.3, §3.8, §3.13): a request that needs nothing read sends the
client's bytes and relays the backend's unchanged (the OpenAI passthrough: no parse, no copy);
before the first streamed byte an error is a real HTTP status, after it an in-band event; a
non-streamed request is opened and read watching its client, so one that leaves stops the
backend (499); the lease is released in the relay's `close()`, which every path reaches.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.responses import Response

from modelyard.config import LlamaCppModel
from modelyard.front.archive import capture as archive_capture
from modelyard.front.chat import forced_call, ollama_fit
from modelyard.front.chat.openai_compat import Reshape
from modelyard.front.chat.render import Render
from modelyard.front.chat.request import ChatCall
from modelyard.front.chat.sessions.relay import (
    begin_turn,
    commit_body,
    refresh_session,
    settle,
    settled,
    tagged,
    tap_sse,
    tap_translated,
)
from modelyard.front.chat.tools import http as tool_loop_http
from modelyard.front.chat.translate import Generation
from modelyard.front.dispatch.final_usage import ask_upstream
from modelyard.front.dispatch.relay import (
    ClientWatch,
    LeasedStream,
    Relay,
    relay_raw,
    translated_stream,
    watched,
)
from modelyard.front.dispatch.swap_progress import open_for_stream
from modelyard.front.request_context import RequestContext
from modelyard.front.state import FrontState
from modelyard.metrics import usage_in_body
from modelyard.wire.speculative import SPECULATIVE_HEADER


async def answer(ctx: RequestContext, call: ChatCall, render: Render) -> Response:
    """Run `call` upstream for the caller of `ctx` and answer it in `render`'s shapes."""
    state = ctx.state
    # A server-side session (`session_id` field or X-Session-Id): its history is spliced in.
    sid = ctx.session_id
    if sid is not None:
        await refresh_session(ctx, sid)  # several fronts or workers: continued from another
    # The server-side tool loop over MCP servers (front/chat/tools/loop.py), when the chat opts in.
    if call.chat and render.tool_loop is not None and (loop := tool_loop_http.tool_loop_for(
            ctx, call.payload, call.model, api=call.api, endpoint=call.endpoint,
            stream=call.stream)) is not None:  # fmt: skip
        answered = await render.tool_loop(ctx, loop, call.model, call.stream)
        if loop.turn is not None and not call.stream:
            await settle(loop.turn)  # a whole answer: its turn is written before it is sent
        # (a streamed one's: before the chunks that follow its commit, tools/http.py)
        return tool_loop_http.finished(loop, answered)
    turn = None if sid is None else begin_turn(ctx, sid, call.model, call.payload)
    payload = call.payload if turn is None else turn.body
    # Archived only when asked (header or `archive` field); the backend never sees the field.
    capture = archive_capture.chat_capture(
        ctx.archive, payload, api=call.api, endpoint=call.endpoint, model=call.model,
        stream=call.stream)
    body = call.body if call.body is not None and turn is None else orjson.dumps(payload)
    gen = None if render.passthrough else Generation.start()
    reshape = call.reshape
    # A forced tool call on llama-server, enforced as a JSON schema (front/chat/forced_call.py).
    force = None
    if call.chat and (forcing := _forced_on_llama_server(state, call, payload)) is not None:
        forced_payload, force = forcing
        body = orjson.dumps(forced_payload)
        if gen is None:
            reshape = reshape if reshape is not None else Reshape(model=call.model)
            reshape.forced = force

    # The backend's final usage, for the request's `usage` event: an OpenAI chat streamed as
    # bytes asks for it even when the client did not, and loses it again on the way back
    # (front/dispatch/final_usage.py). (n > 1 is asked for it already, and summed: Reshape.)
    strip = False
    if gen is None and call.stream and call.chat and \
            (asked := ask_upstream(payload, body)) is not None:  # fmt: skip
        body, strip = asked
    several = reshape is not None and reshape.n > 1

    # A non-streamed answer is awaited watching the client: one that leaves stops it.
    watch = None if call.stream else ClientWatch(ctx.receive, ctx.client_gone)

    def send(sent: bytes, say: Callable[[str], None] | None) -> Awaitable[Relay]:
        return state.dispatch.open_relay(
            call.serve_as or call.model, call.path, sent, keep_alive_s=call.keep_alive_s,
            priority=ctx.priority, client=None if watch else ctx.receive, on_progress=say,
            session_kv=None if turn is None else turn.kv, affinity=sid,
        )

    def open_relay(say: Callable[[str], None] | None) -> Awaitable[Relay]:
        if call.fit is None:
            return send(body, say)
        # Ollama cuts a prompt longer than the context (front/chat/ollama_fit.py).
        return ollama_fit.fitted(lambda sent: send(sent, say), body, call, call.fit)

    def stream_body(relay: Relay) -> AsyncIterator[bytes]:
        chunks = framed_body(relay)
        if turn is not None and turn.store.shared:  # its end waits for the turn's write
            chunks = settled(turn, chunks)
        return chunks

    def framed_body(relay: Relay) -> AsyncIterator[bytes]:
        if gen is None:  # the backend's SSE, unchanged
            chunks = relay_raw(relay, render.error_event,
                               None if several else relay.final_usage(strip=strip))
            if reshape is not None:
                chunks = reshape.stream(chunks)
            if turn is not None:
                chunks = tap_sse(turn, chunks)
            return chunks if capture is None else capture.tap_sse(chunks)
        gen.load_duration_ns = relay.lease.load_duration_ns
        absorb: Callable[[dict[str, Any]], str] = gen.absorb
        if force is not None:
            absorb = _forced_absorb(force, gen.absorb)

        def closing() -> bytes:
            return render.done(call, gen)

        on_done: Callable[[], bytes] = closing
        if turn is not None:
            absorb, on_done = tap_translated(turn, absorb, on_done)
        chunks = translated_stream(
            relay, absorb,
            on_text=lambda text: render.text(call, gen, text),
            on_done=on_done,
            on_error=render.error_event,
            on_event=lambda: render.thinking(call, gen, gen.thinking_delta)
            if gen.thinking_delta else None,
        )
        return chunks if capture is None else capture.tap_generation(chunks, gen)

    opened = await watched(watch, open_for_stream(
        open_relay,
        enabled=call.stream and call.progress and state.catalog.settings.notify_model_swap,
        render_progress=lambda text: render.progress(call, gen, text),
        render_error=render.error_event,
        body=stream_body,
        media_type=render.media_type,
    ))
    if not isinstance(opened, Relay):  # swap progress is streaming
        return tagged(opened if capture is None else capture.attach(opened), turn)
    relay = opened
    if gen is not None:
        gen.load_duration_ns = relay.lease.load_duration_ns
    if relay.status != 200:
        failed = render.upstream_error(call, relay.status, relay.content_type, await relay.read())
        return tagged(failed, turn)
    if call.stream:
        response: Response = LeasedStream(stream_body(relay), relay, render.media_type)
    elif gen is None:  # a whole OpenAI answer, unchanged
        raw = await relay.read()
        if reshape is not None:
            raw = reshape.whole(raw)
            if several:  # the choices' usages, summed
                relay.report_usage(usage_in_body(raw))
        if turn is not None:
            commit_body(turn, raw)
        if capture is not None:
            capture.save_response(raw)
        response = Response(raw, media_type="application/json")
    else:
        whole = orjson.loads(await relay.read())
        if force is not None:
            whole = force.whole(whole)
        gen.absorb(whole)
        if turn is not None:
            commit_body(turn, whole)
        if capture is not None:
            capture.save_generation(gen)
        response = render.whole(call, gen)
    if turn is not None and not call.stream:
        await settle(turn)  # several workers: the next turn may go to another one
    # The engine's word on speculative decoding for this answer (a transformers model says why
    # its draft is not used): one header lookup, passed on.
    note = relay.header(SPECULATIVE_HEADER)
    if note is not None:
        response.headers[SPECULATIVE_HEADER] = note
    return tagged(response if capture is None else capture.attach(response), turn)


def _forced_on_llama_server(state: FrontState, call: ChatCall, payload: dict[str, Any]
                            ) -> tuple[dict[str, Any], forced_call.ForcedCall] | None:
    """The rewritten request and its answer's conversion when `payload` forces a tool call and
    llama-server serves the model (the transformers engine enforces it itself)."""
    if payload.get("tool_choice") in (None, "auto", "none"):
        return None
    entry = state.catalog.registry.get(call.serve_as or call.model)
    if entry is None or not isinstance(entry.spec, LlamaCppModel):
        return None
    return forced_call.plan(payload)


def _forced_absorb(force: forced_call.ForcedCall,
                   absorb: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], str]:
    def forced(payload: dict[str, Any]) -> str:
        return "".join(absorb(event) for event in force.events(payload))

    return forced
