"""How the OpenAI Responses API frames an answer (front/chat/render.py's contract): a Response
object, or its documented stream of typed events, each with its `sequence_number`:

    response.created, response.in_progress,
    response.output_item.added (message), response.content_part.added,
    response.output_text.delta …, response.output_text.done, response.content_part.done,
    response.output_item.done,
    per tool call: response.output_item.added (function_call),
        response.function_call_arguments.delta, …arguments.done, response.output_item.done,
    response.completed (response.incomplete when max_output_tokens cut it).

An error after the first byte is an `error` event, then `response.failed`. Unlike the other
renderers this one holds the request's stream state (the sequence numbers, which items are
open), so the route makes one per request. A tool call's arguments go out as one delta when the
answer ends: the pipeline reads them whole (translate.Generation), the SDKs accept either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from starlette.responses import Response

from modelyard.errors import ModelyardError
from modelyard.front.chat.render import Render
from modelyard.front.chat.request import ChatCall
from modelyard.front.chat.responses_shapes import (
    function_call_item,
    incomplete,
    message_item,
    new_id,
    output_text_part,
    response_object,
)
from modelyard.front.chat.translate import Generation


class ResponsesRender(Render):
    """One request's Responses framing; `on_final` is told the finished Response object (to
    store it) before the client sees its end."""

    def __init__(self, head: dict[str, Any],
                 on_final: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.head = head
        self.on_final = on_final
        self.seq = 0
        self.started = False
        self.text_open = False
        self.msg_id = new_id("msg")

    # ---- events ----------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        state = response_object(self.head, [], None, "in_progress")
        return (self._event("response.created", response=state)
                + self._event("response.in_progress", response=state))

    def _open_text(self) -> bytes:
        if self.text_open:
            return b""
        self.text_open = True
        return (self._event("response.output_item.added", output_index=0,
                            item=message_item(self.msg_id, "", "in_progress"))
                + self._event("response.content_part.added", item_id=self.msg_id,
                              output_index=0, content_index=0, part=output_text_part("")))

    def _output(self, gen: Generation) -> list[dict[str, Any]]:
        out = []
        if gen.content or not gen.tool_calls:
            out.append(message_item(self.msg_id, gen.content))
        for index, slot in sorted(gen.tool_calls.items()):
            out.append(function_call_item(f"fc_{self.msg_id[4:]}_{index}",
                                          slot["id"] or new_id("call"), slot["name"],
                                          slot["arguments"]))
        return out

    def _final(self, gen: Generation) -> dict[str, Any]:
        status = "incomplete" if incomplete(gen) else "completed"
        final = response_object(self.head, self._output(gen), gen, status)
        if self.on_final is not None:
            self.on_final(final)
        return final

    # ---- the Render contract -----------------------------------------------------------------

    def progress(self, call: ChatCall, gen: Generation | None, text: str) -> bytes:
        return b""  # the route asks for no swap progress: Responses has no place for it

    def error_event(self, exc: ModelyardError) -> bytes:
        failed = {**response_object(self.head, [], None, "failed"),
                  "error": {"code": "server_error", "message": exc.full_message()}}
        return (self._start()
                + self._event("error", code=exc.code, message=exc.full_message(),
                              param=exc.param)
                + self._event("response.failed", response=failed))

    def upstream_error(self, call: ChatCall, status: int, content_type: str,
                       body: bytes) -> Response:  # fmt: skip
        # Upstream 4xx/5xx pass through unchanged (llama-server's are in the OpenAI envelope).
        return Response(body, status_code=status, media_type=content_type)

    def text(self, call: ChatCall, gen: Generation, text: str) -> bytes:
        return self._start() + self._open_text() + self._event(
            "response.output_text.delta", item_id=self.msg_id, output_index=0,
            content_index=0, delta=text, logprobs=[])

    def done(self, call: ChatCall, gen: Generation) -> bytes:
        final = self._final(gen)
        out = [self._start()]
        for index, item in enumerate(final["output"]):
            if item["type"] == "message":
                out.append(self._open_text())
                out.append(self._event("response.output_text.done", item_id=item["id"],
                                       output_index=index, content_index=0,
                                       text=gen.content, logprobs=[]))
                out.append(self._event("response.content_part.done", item_id=item["id"],
                                       output_index=index, content_index=0,
                                       part=item["content"][0]))
            else:
                out.append(self._event("response.output_item.added", output_index=index,
                                       item={**item, "arguments": "", "status": "in_progress"}))
                out.append(self._event("response.function_call_arguments.delta",
                                       item_id=item["id"], output_index=index,
                                       delta=item["arguments"]))
                out.append(self._event("response.function_call_arguments.done",
                                       item_id=item["id"], output_index=index,
                                       name=item["name"], arguments=item["arguments"]))
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        out.append(self._event(kind, response=final))
        return b"".join(out)

    def whole(self, call: ChatCall, gen: Generation) -> Response:
        return Response(orjson.dumps(self._final(gen)), media_type="application/json")
