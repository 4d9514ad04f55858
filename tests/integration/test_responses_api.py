"""The OpenAI Responses API (/v1/responses) through a real `modelyard serve` and the fake
llama-server, driven by the official `openai` SDK: create, stream (every event parsed by the
SDK, sequence numbers in order), function tools and their outputs, `previous_response_id`
chains on the server-side sessions (what the backend was sent shows the history), `store:
false`, 404s, 400s, an in-band error mid-stream, and another owner's response."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from tests.integration.harness import config, model_status, module_server
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

TEXT_16 = "The quick brown fox jumps over the lazy dog by a river The quick brown fox"
WEATHER = {"type": "function", "name": "weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # `--mmproj`: the fake takes image parts (a projector is only logged).
    cfg = config(fake_model("m", "--mmproj", "proj.gguf"),
                 fake_model("crashy", "--crash-after-tokens", "2"))
    with module_server(tmp_path_factory, cfg, "--single-process") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)


def sent(server: Server, model: str = "m") -> list[dict[str, Any]]:
    """The chat bodies the fake backend was sent, oldest first."""
    found = model_status(server, model)
    assert found is not None and found["upstream"]
    return list(httpx.get(found["upstream"] + "/requests", timeout=10).json())


def roles_and_text(messages: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(m["role"], m.get("content")) for m in messages]


def test_create_answers_a_response_object(client: openai.OpenAI, server: Server) -> None:
    r = client.responses.create(model="m", input="Hi there", instructions="Be brief.",
                                metadata={"k": "v"})
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == TEXT_16
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage is not None and r.usage.output_tokens == 16
    assert r.usage.total_tokens == r.usage.input_tokens + 16
    assert r.metadata == {"k": "v"} and r.instructions == "Be brief."
    assert roles_and_text(sent(server)[-1]["messages"]) == [
        ("system", "Be brief."), ("user", "Hi there")]


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI, server: Server) -> None:
    r = client.responses.create(model="m", input="Hi", max_output_tokens=3,
                                temperature=0.5, top_p=0.9)
    assert r.status == "incomplete" and r.output_text == "The quick brown"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    body = sent(server)[-1]
    assert (body["max_tokens"], body["temperature"], body["top_p"]) == (3, 0.5, 0.9)


def test_input_items_become_chat_messages(client: openai.OpenAI, server: Server) -> None:
    png = "data:image/png;base64,iVBORw0KGgo="
    client.responses.create(model="m", input=[
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": [{"type": "input_text", "text": "Look"},
                                     {"type": "input_image", "image_url": png}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Seen."}]},
        {"type": "message", "role": "user", "content": "Again"},
    ], store=False)
    assert sent(server)[-1]["messages"] == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": [{"type": "text", "text": "Look"},
                                     {"type": "image_url", "image_url": {"url": png}}]},
        {"role": "assistant", "content": "Seen."},
        {"role": "user", "content": "Again"}]


def test_stream_events_in_order(client: openai.OpenAI) -> None:
    with client.responses.stream(model="m", input="Hi") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == TEXT_16 == final.output_text
    assert final.usage is not None and final.usage.output_tokens == 16


def test_stream_cut_by_max_output_tokens_ends_incomplete(client: openai.OpenAI) -> None:
    # As OpenAI's: `response.incomplete` closes the stream (LangChain reads it as the end).
    events = list(client.responses.create(model="m", input="Hi", max_output_tokens=5,
                                          stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details is not None
    assert events[-1].response.output[0].content[0].text == "The quick brown fox jumps"


def test_tool_call_round_trip(client: openai.OpenAI, server: Server) -> None:
    first = client.responses.create(model="m", input='call weather {"city": "Oslo"}',
                                    tools=[WEATHER])
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("weather", {"city": "Oslo"})]
    assert sent(server)[-1]["tools"] == [{"type": "function", "function": {
        "name": "weather", "description": "Weather in a city",
        "parameters": WEATHER["parameters"]}}]  # fmt: skip
    second = client.responses.create(
        model="m", previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "sunny"}])
    assert second.output_text == "tool said: sunny"
    messages = sent(server)[-1]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["id"] == calls[0].call_id
    assert messages[2] == {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"}


def test_tool_call_streamed(client: openai.OpenAI) -> None:
    with client.responses.stream(model="m", input='call weather {"city": "Rome"}',
                                 tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [{"city": "Rome"}]
    assert events[-1].type == "response.completed"
    assert [i.type for i in final.output] == ["function_call"]


def test_function_call_items_in_input(client: openai.OpenAI, server: Server) -> None:
    client.responses.create(model="m", tools=[WEATHER], store=False,
                            input=[{"role": "user", "content": "weather?"},
                                   {"type": "function_call", "call_id": "c1", "name": "weather",
                                    "arguments": '{"city":"Oslo"}'},
                                   {"type": "function_call_output", "call_id": "c1",
                                    "output": "rain"}])
    messages = sent(server)[-1]["messages"]
    assert messages[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]}  # fmt: skip


def test_previous_response_id_chain(client: openai.OpenAI, server: Server) -> None:
    r1 = client.responses.create(model="m", input="One", instructions="Be brief.",
                                 max_output_tokens=2)
    # OpenAI does not carry `instructions` over: the history without them.
    r2 = client.responses.create(model="m", input="Two", previous_response_id=r1.id,
                                 max_output_tokens=2)
    assert roles_and_text(sent(server)[-1]["messages"]) == [
        ("user", "One"), ("assistant", "The quick"), ("user", "Two")]
    # Continuing the latest response of a chain: only the new input was sent by the client.
    client.responses.create(model="m", input="Three", previous_response_id=r2.id,
                            instructions="New rules.", max_output_tokens=2)
    assert roles_and_text(sent(server)[-1]["messages"]) == [
        ("system", "New rules."), ("user", "One"), ("assistant", "The quick"),
        ("user", "Two"), ("assistant", "The quick"), ("user", "Three")]
    # A fork from the first: only its history, not the later turns.
    client.responses.create(model="m", input="Other", previous_response_id=r1.id,
                            instructions="Be brief.", max_output_tokens=2)
    assert roles_and_text(sent(server)[-1]["messages"]) == [
        ("system", "Be brief."), ("user", "One"), ("assistant", "The quick"), ("user", "Other")]
    got = client.responses.retrieve(r2.id)
    assert got.id == r2.id and got.output_text == "The quick"
    assert got.previous_response_id == r1.id


def test_store_false_keeps_nothing(client: openai.OpenAI, server: Server) -> None:
    kept = client.responses.create(model="m", input="A", max_output_tokens=2)
    gone = client.responses.create(model="m", input="B", store=False,
                                   previous_response_id=kept.id, max_output_tokens=2)
    assert gone.store is False
    assert roles_and_text(sent(server)[-1]["messages"]) == [
        ("user", "A"), ("assistant", "The quick"), ("user", "B")]
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(gone.id)
    assert err.value.code == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="C", previous_response_id=gone.id)
    # The kept one was not extended by the unstored continuation.
    after = client.responses.create(model="m", input="D", previous_response_id=kept.id,
                                    max_output_tokens=2)
    assert after.status == "incomplete"
    assert roles_and_text(sent(server)[-1]["messages"]) == [
        ("user", "A"), ("assistant", "The quick"), ("user", "D")]


def test_delete_and_404s(client: openai.OpenAI) -> None:
    r = client.responses.create(model="m", input="A", max_output_tokens=1)
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id),
                 lambda: client.responses.delete(r.id),
                 lambda: client.responses.retrieve("resp_unknown"),
                 lambda: client.responses.create(model="m", input="x",
                                                 previous_response_id="resp_unknown")):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.code == "response_not_found"


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m"}, "input"),
    ({"model": "m", "input": 5}, "input"),
    ({"model": "m", "input": "x", "temperature": 3}, "temperature"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m", "input": "x", "tools": [{"type": "function"}]}, "tools.0.name"),
    ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": ""}]}]}, "input.0.content.0.image_url"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"model": "m", "input": "x", "tool_choice": {"type": "function"}}, "tool_choice"),
])  # fmt: skip
def test_client_mistakes_are_400s(server: Server, body: dict[str, Any], param: str) -> None:
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_request" and error["param"] == param


def test_text_format_json_schema(client: openai.OpenAI, server: Server) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    client.responses.create(model="m", input="x", store=False, max_output_tokens=1,
                            text={"format": {"type": "json_schema", "name": "obj",
                                             "schema": schema, "strict": True}})
    assert sent(server)[-1]["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "obj", "schema": schema, "strict": True}}


def test_error_mid_stream_is_in_band(server: Server) -> None:
    body = {"model": "crashy", "input": "Hi", "stream": True, "store": False}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=30) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_another_owner_gets_404(start_server: Any) -> None:
    server = start_server(config(fake_model("m"), auth="required"), "--single-process")
    admin = httpx.Client(base_url=server.url, headers=server.admin_headers, timeout=30)
    clients = {}
    for name in ("carol", "dave"):
        r = admin.post("/admin/users", json={"name": name, "password": f"{name}-pw-123",
                                              "must_change_password": False})
        assert r.status_code in (200, 201), r.text
        r = admin.post("/tokens", json={"name": f"{name}-t", "owner": name})
        assert r.status_code in (200, 201), r.text
        clients[name] = openai.OpenAI(base_url=server.url + "/v1", api_key=r.json()["token"],
                                      max_retries=0, timeout=30)
    mine = clients["carol"].responses.create(model="m", input="A", max_output_tokens=1)
    assert clients["carol"].responses.retrieve(mine.id).id == mine.id
    with pytest.raises(openai.NotFoundError):
        clients["dave"].responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        clients["dave"].responses.create(model="m", input="B", previous_response_id=mine.id)
    with pytest.raises(openai.NotFoundError):
        clients["dave"].responses.delete(mine.id)
    assert clients["carol"].responses.retrieve(mine.id).id == mine.id
