"""What the hot lane (front/api/lane.py) takes as plain: a request it answers must be one the
regular route would answer by relaying its bytes unchanged; anything else goes on to the route,
with the messages that brought its body replayed exactly."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.types import Message

from modelyard.front.api.lane import _read, _replay, plain_chat, plain_embedding

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

HI = [{"role": "user", "content": "hi"}]
CHAT = {"model": "m", "messages": HI}


@pytest.mark.parametrize("data", [
    CHAT,
    {**CHAT, "max_tokens": 1, "temperature": 0.5, "top_p": 1, "seed": 3, "stop": ["x"]},
    {**CHAT, "stream": False, "user": "u", "presence_penalty": -1.5, "max_completion_tokens": 0},
    {"model": "m", "messages": [{"role": "system", "content": ""}, *HI,
                                {"role": "assistant", "content": "yo", "name": "bot"}]},
])
def test_plain_chats(data: dict[str, Any]) -> None:
    assert plain_chat(data)


@pytest.mark.parametrize("data", [
    [CHAT],  # not an object
    {"messages": HI},  # no model
    {**CHAT, "model": ""},
    {**CHAT, "messages": []},
    {**CHAT, "stream": True},  # a stream: the pipeline's (usage asked upstream, swap progress)
    {**CHAT, "stream": "no"},
    {**CHAT, "n": 2},
    {**CHAT, "tools": []},
    {**CHAT, "session_id": "s"},
    {**CHAT, "archive": True},
    {**CHAT, "keep_alive": 0},
    {**CHAT, "response_format": {"type": "json_object"}},
    {**CHAT, "logprobs": True},
    {**CHAT, "max_tokens": -1},  # the route's 400
    {**CHAT, "max_tokens": True},
    {**CHAT, "max_tokens": 1.5},
    {**CHAT, "temperature": -1},
    {**CHAT, "top_p": 2},
    {**CHAT, "stop": 3},
    {**CHAT, "user": 1},
    {"model": "m", "messages": [{"role": "tool", "content": "1"}]},
    {"model": "m", "messages": [{"role": "function", "content": "1", "name": "f"}]},
    {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    {"model": "m", "messages": [{"role": "user", "content": None}]},
    {"model": "m", "messages": [{"role": "assistant", "content": "", "tool_calls": []}]},
    {"model": "m", "messages": ["hi"]},
])
def test_not_plain_chats(data: Any) -> None:
    assert not plain_chat(data)


@pytest.mark.parametrize(("data", "plain"), [
    ({"model": "e", "input": "a"}, True),
    ({"model": "e", "input": ["a", "b"], "encoding_format": "base64", "user": "u"}, True),
    ({"model": "e", "input": ""}, False),  # the route's 400
    ({"model": "e", "input": []}, False),
    ({"model": "e", "input": ["a", ""]}, False),
    ({"model": "e", "input": [1, 2]}, False),  # token ids: decoded by the route
    ({"model": "e", "input": "a", "dimensions": 8}, False),
    ({"model": "e", "input": "a", "encoding_format": "int8"}, False),
    ({"input": "a"}, False),
    ({"model": "e", "input": "a", "user": 3}, False),
])
def test_plain_embeddings(data: Any, plain: bool) -> None:
    assert plain_embedding(data) is plain


def _receive(messages: list[Message]) -> Any:
    queue: asyncio.Queue[Message] = asyncio.Queue()
    for message in messages:
        queue.put_nowait(message)
    return queue.get


def _scope(*headers: tuple[bytes, bytes]) -> dict[str, Any]:
    return {"headers": list(headers), "modelyard.principal": None}


async def test_a_body_read_in_parts_is_replayed_part_by_part_then_the_clients_channel() -> None:
    parts: list[Message] = [
        {"type": "http.request", "body": b'{"model": "m", ', "more_body": True},
        {"type": "http.request", "body": b'"messages": []}', "more_body": False},
    ]
    receive = _receive([*parts, {"type": "http.disconnect"}])
    read, data, priority = await _read(_scope(), receive)
    assert data == {"model": "m", "messages": []} and priority == 0
    replayed = _replay(read, receive)
    assert [await replayed(), await replayed(), await replayed()] == [
        *parts, {"type": "http.disconnect"}]


async def test_a_client_gone_before_its_body_ended_is_not_on_the_lane() -> None:
    parts: list[Message] = [{"type": "http.request", "body": b'{"a":', "more_body": True},
                            {"type": "http.disconnect"}]
    read, data, _ = await _read(_scope(), _receive(parts))
    assert data is None and read == parts


@pytest.mark.parametrize("header", [b"x-session-id", b"x-modelyard-archive"])
async def test_a_session_or_archive_header_takes_a_request_off_the_lane(header: bytes) -> None:
    body: Message = {"type": "http.request", "body": b'{"model": "m"}', "more_body": False}
    _, data, _ = await _read(_scope((header, b"1")), _receive([body]))
    assert data is None


async def test_a_body_that_is_not_json_goes_to_the_route() -> None:
    body: Message = {"type": "http.request", "body": b"{nope", "more_body": False}
    read, data, _ = await _read(_scope(), _receive([body]))
    assert data is None and read == [body]
