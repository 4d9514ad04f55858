"""A streamed tool-loop turn in a chat session shared by several processes (`serve --workers
N`): the chunks after its commit wait until the database has the turn (tools/http.py
`streamed_body`), as a plain streamed turn's do, so the client cannot see the answer end before
another worker could continue the session."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import pytest

from modelyard import db
from modelyard.config import Settings
from modelyard.front.chat.sessions.relay import commit_body
from modelyard.front.chat.sessions.store import SessionStore
from modelyard.front.chat.tools.http import streamed_body
from modelyard.front.chat.tools.loop import McpHub, ToolLoop

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]

ANSWER = {"choices": [{"index": 0, "finish_reason": "stop",
                       "message": {"role": "assistant", "content": "tool said: 5"}}]}


async def test_the_end_of_a_streamed_loop_waits_for_its_turn_in_the_database(
        tmp_path: Path) -> None:  # fmt: skip
    store = SessionStore(database=db.connect(f"sqlite:///{tmp_path / 'm.db'}"), shared=True)
    await store.start()
    turn = store.begin("alice", "s", "m", {"model": "m", "messages": [
        {"role": "user", "content": "add 2 and 3"}]})
    loop = ToolLoop(cast(McpHub, None), Settings(home=tmp_path), turn.body, ["test"])
    loop.turn = turn

    async def rounds() -> AsyncIterator[bytes]:
        yield b"data: {round 1}\n\n"
        commit_body(turn, ANSWER)  # the loop's answer: the session's turn, written behind
        yield b"data: {the answer}\n\n"
        yield b"data: [DONE]\n\n"

    body = streamed_body(loop, rounds())
    assert await anext(body) == b"data: {round 1}\n\n"
    async with store._writing:  # the database is busy: the answer's end waits for it
        after_commit = asyncio.ensure_future(anext(body))
        await asyncio.sleep(0.05)  # room for a chunk that would not wait
        assert not after_commit.done()
    assert await asyncio.wait_for(after_commit, 5) == b"data: {the answer}\n\n"
    assert not store.pending("alice", "s")  # written before that chunk went out
    # another process (a second store on the same database) reads the turn
    other = SessionStore(database=db.connect(f"sqlite:///{tmp_path / 'm.db'}"), shared=True)
    await other.refresh("alice", "s")
    stored = other.get("alice", "s")
    assert stored is not None and stored.turns == 1
    assert stored.messages[-1] == {"role": "assistant", "content": "tool said: 5"}
    assert [chunk async for chunk in body] == [b"data: [DONE]\n\n"]
    await store.stop()


