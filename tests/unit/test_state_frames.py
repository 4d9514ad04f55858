"""State frames (wire/lease.py): the engine pushes its status on the lease channel after each
change of its models, coalesced, so routing reads the front's copy instead of /status."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import orjson
import pytest

from modelyard.engine import lease_channel
from modelyard.wire.lease import (
    Hello,
    State,
    decode_engine_frame,
    decode_front_frame,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def test_state_round_trips() -> None:
    frame = State(3, {"engine": 1, "models": []})
    assert decode_engine_frame(frame.encode()) == frame


def test_the_hello_asks_for_state_and_an_old_hello_does_not() -> None:
    asked = decode_front_frame(Hello("s" * 32, 1, state=True).encode())
    assert isinstance(asked, Hello) and asked.state
    old = decode_front_frame(b'{"op":"hello","secret":"' + b"s" * 32 + b'","protocol":1}\n')
    assert isinstance(old, Hello) and not old.state
    # An old front's hello is byte for byte what it was: nothing new for an old engine.
    assert b"state" not in Hello("s" * 32, 1).encode()


class FakeEngine:
    """What the channel's State pusher reads: the change event and the status."""

    def __init__(self) -> None:
        self._changed = asyncio.Event()
        self.statuses = 0
        self.slot_wanted: set[Callable[[str], None]] = set()  # the channel's Wanted listeners

    def change_event(self) -> asyncio.Event:
        return self._changed

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def status(self) -> Any:
        self.statuses += 1
        n = self.statuses

        class Status:
            def to_json(self) -> dict[str, Any]:
                return {"n": n}

        return Status()


class Writer:
    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []
        self.arrived = asyncio.Event()

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.frames.append(orjson.loads(data))
        self.arrived.set()

    def close(self) -> None:
        pass

    async def next_frame(self, count: int) -> dict[str, Any]:
        while len(self.frames) < count:
            self.arrived.clear()
            await self.arrived.wait()
        return self.frames[count - 1]


async def test_state_is_sent_at_once_then_once_per_burst_of_changes() -> None:
    engine, writer = FakeEngine(), Writer()
    conn = lease_channel._Connection(cast(Any, engine), cast(Any, writer))
    conn.push_state()
    try:
        first = await asyncio.wait_for(writer.next_frame(1), 5)
        assert first == {"op": "state", "version": 1, "status": {"n": 1}}
        for _ in range(10):  # a burst: loads, evictions, one after the other
            engine.notify()
        second = await asyncio.wait_for(writer.next_frame(2), 5)
        assert second == {"op": "state", "version": 2, "status": {"n": 2}}
        engine.notify()  # a later change: one more frame, so the burst made exactly one
        third = await asyncio.wait_for(writer.next_frame(3), 5)
        assert third["version"] == 3 and engine.statuses == 3
    finally:
        conn.close()
        assert conn.pushing is not None
        with pytest.raises(asyncio.CancelledError):
            await conn.pushing
