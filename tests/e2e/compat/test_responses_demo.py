"""End to end: the OpenAI Responses API (/v1/responses) with the real llama-server and the demo
model, driven by the official `openai` SDK unchanged: create, stream, a `previous_response_id`
chain on the server-side sessions, retrieve and delete."""

from __future__ import annotations

import httpx
import openai
import pytest
from tests.support import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def server(compat_server: Server) -> Server:
    """The suite's shared server (tests/e2e/compat/conftest.py): the same config as this
    module would start."""
    return compat_server


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120,
                         max_retries=0)


def test_create_stream_and_chain(server: Server, oai: openai.OpenAI) -> None:
    # Greedy both times: a sampled first answer made the continuation's length vary, and one
    # that ran to its limit ended `response.incomplete`, which the SDK's stream helper refuses
    # as a final response (1 run in 3 here).
    first = oai.responses.create(model="smollm2", instructions="Answer in one word.",
                                 input="Name one colour of the rainbow.", max_output_tokens=8,
                                 temperature=0)
    assert first.status in ("completed", "incomplete") and first.output_text.strip()
    assert first.usage is not None and first.usage.output_tokens > 0
    assert oai.responses.retrieve(first.id).output_text == first.output_text

    with oai.responses.stream(model="smollm2", input="And another one?",
                              instructions="Answer in one word.",
                              previous_response_id=first.id, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and deltas.strip()
    assert final.previous_response_id == first.id
    # The continuation is one more turn of the first one's server-side session: the history
    # the client did not resend was spliced in there.
    session = httpx.get(f"{server.url}/v1/sessions/{first.id}", timeout=10).json()
    assert session["turns"] == 2
    assert [m["role"] for m in session["messages"]] == [
        "system", "user", "assistant", "user", "assistant"]
    assert session["messages"][-1]["content"] == final.output_text
    assert oai.responses.retrieve(final.id).output_text == final.output_text

    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
    assert oai.responses.retrieve(final.id).id == final.id
