"""The lease channel's writes: the frames of one event-loop turn go out in one write, in order,
over a real loopback connection (the reader on the other end sees them as the lines they were)."""

from __future__ import annotations

import asyncio

import pytest

from modelyard.wire.lease import CoalescedWriter

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


class CountingWriter(asyncio.StreamWriter):
    """A real StreamWriter that counts its writes (each one is a send() on its socket)."""

    writes = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        type(self).writes += 1
        super().write(data)


async def _pair() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A loopback connection: the far end's reader, and our writer counting its writes."""
    accepted: asyncio.Future[asyncio.StreamReader] = asyncio.get_running_loop().create_future()

    async def on_connect(reader: asyncio.StreamReader, _: asyncio.StreamWriter) -> None:
        accepted.set_result(reader)

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.__class__ = CountingWriter
    return await accepted, writer


async def test_frames_of_one_turn_go_in_one_write_and_keep_their_order() -> None:
    reader, writer = await _pair()
    CountingWriter.writes = 0
    out = CoalescedWriter(writer)
    for n in range(5):
        out.write(b'{"op":"release","lease":"%d"}\n' % n)
    assert CountingWriter.writes == 0  # nothing sent before the turn ends
    lines = [await reader.readline() for _ in range(5)]
    assert lines == [b'{"op":"release","lease":"%d"}\n' % n for n in range(5)]
    assert CountingWriter.writes == 1
    out.write(b'{"op":"ping"}\n')  # a later turn: a write of its own
    assert await reader.readline() == b'{"op":"ping"}\n'
    assert CountingWriter.writes == 2
    writer.close()


async def test_a_frame_for_a_closed_writer_is_dropped() -> None:
    reader, writer = await _pair()
    CountingWriter.writes = 0
    out = CoalescedWriter(writer)
    out.write(b'{"op":"ping"}\n')
    writer.close()
    await asyncio.sleep(0)  # the turn ends: the flush finds the writer closing
    await asyncio.sleep(0)
    assert CountingWriter.writes == 0
    assert await reader.read() == b""
