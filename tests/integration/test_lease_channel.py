"""The lease channel over real loopback sockets, with an engine whose model is a fake process:
leases, their release when a connection closes, the hello that only the secret's holder passes,
the heartbeat that finds an engine which stopped answering, and lease reuse (a lease given
back taken again without a grant; given back for real after the linger or a change of models)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.support import fake_model

from modelyard.config import OpenAIServerModel, Settings
from modelyard.engine.lease_channel import serve_lease_channel
from modelyard.engine.loop import Engine
from modelyard.errors import EngineUnavailable, ModelNotFound
from modelyard.front.engines.idle_leases import LINGER_S, IdleLeases
from modelyard.front.engines.lease_client import LeaseChannelRefused, LeaseClient
from modelyard.store.registry import ModelRegistry
from modelyard.types import Lease
from modelyard.wire.lease import (
    PROTOCOL,
    Acquire,
    FrontFrame,
    Granted,
    HelloReply,
    Progress,
    Release,
    decode_engine_frame,
    decode_front_frame,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SECRET = "s3cret-for-this-test"


async def _until(condition: object, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.01)


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    settings = Settings(
        home=tmp_path,
        scan_hf_cache=False,
        models=[
            OpenAIServerModel.model_validate(fake_model("fast")),
            OpenAIServerModel.model_validate(fake_model("slow", "--load-time-s", "1.5")),
        ],
    )
    engine = Engine(settings, ModelRegistry.build(settings))
    yield engine
    await engine.shutdown()


@pytest.fixture
async def channel(engine: Engine) -> AsyncIterator[tuple[Engine, int]]:
    server = await serve_lease_channel(engine, SECRET)
    yield engine, int(server.sockets[0].getsockname()[1])
    server.close()


async def _flush(client: LeaseClient) -> None:
    """Two round trips: any grant that raced a cancel has come back and been returned."""
    for _ in range(2):
        client.release((await client.acquire("fast")).id)


def _leases(engine: Engine, model: str) -> int:
    return next((m["leases"] for m in engine.model_status() if m["model"] == model), 0)


async def test_acquire_and_release(channel: tuple[Engine, int]) -> None:
    engine, port = channel
    client = await LeaseClient.connect("127.0.0.1", port, SECRET)
    lease = await client.acquire("fast")
    assert lease.model == "fast" and lease.upstream.startswith("http://127.0.0.1:")
    assert _leases(engine, "fast") == 1
    client.release(lease.id)
    await _until(lambda: _leases(engine, "fast") == 0)
    await client.close()


async def test_errors_come_back_as_the_same_class(channel: tuple[Engine, int]) -> None:
    _, port = channel
    client = await LeaseClient.connect("127.0.0.1", port, SECRET)
    with pytest.raises(ModelNotFound):
        await client.acquire("ghost")
    await client.close()


async def test_a_closed_connection_gives_its_leases_back(channel: tuple[Engine, int]) -> None:
    engine, port = channel
    client = await LeaseClient.connect("127.0.0.1", port, SECRET)
    await client.acquire("fast")
    await client.acquire("fast")
    assert _leases(engine, "fast") == 2
    await client.close()  # e.g. the front crashed
    await _until(lambda: _leases(engine, "fast") == 0)


async def test_a_cancelled_wait_leaks_no_lease(channel: tuple[Engine, int]) -> None:
    engine, port = channel
    client = await LeaseClient.connect("127.0.0.1", port, SECRET)
    waiting = asyncio.create_task(client.acquire("slow"))
    await _until(lambda: any(m["state"] == "loading" for m in engine.model_status()))
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    # The load goes on (others may want it) and ends ready, but with no lease held.
    await _until(lambda: any(m["state"] == "ready" for m in engine.model_status()))
    await _flush(client)
    assert _leases(engine, "slow") == 0
    lease = await client.acquire("slow")
    assert _leases(engine, "slow") == 1
    client.release(lease.id)
    await client.close()


@pytest.mark.parametrize(
    "first_line",
    [
        b'{"op": "acquire", "id": 1, "model": "fast"}\n',  # no hello at all
        b'{"op": "hello", "secret": "guess", "protocol": 1}\n',
        b'{"op": "hello", "protocol": 1}\n',
        b'{"op": "hello", "secret": ["s3cret-for-this-test"], "protocol": 1}\n',
        b'not json\n',
    ],
)
async def test_a_connection_without_the_secret_gets_no_lease(
    channel: tuple[Engine, int], first_line: bytes
) -> None:
    engine, port = channel
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(first_line + b'{"op": "acquire", "id": 2, "model": "fast"}\n')
    await writer.drain()
    async with asyncio.timeout(10):
        assert await reader.read() == b""  # closed, with no grant and no answer at all
    writer.close()
    assert _leases(engine, "fast") == 0
    assert all(m["state"] != "loading" for m in engine.model_status())
    with pytest.raises(LeaseChannelRefused):
        await LeaseClient.connect("127.0.0.1", port, "not-the-secret")


async def test_the_raw_hello_with_the_secret_is_answered(channel: tuple[Engine, int]) -> None:
    engine, port = channel
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b'{"op": "hello", "secret": "%s", "protocol": 1}\n' % SECRET.encode())
    writer.write(b'{"op": "ping"}\n{"op": "acquire", "id": 1, "model": "fast"}\n')
    async with asyncio.timeout(10):
        lines = [await reader.readline() for _ in range(3)]
    assert lines[0] == b'{"op":"hello","protocol":1}\n' and lines[1] == b'{"op":"pong"}\n'
    assert b'"lease"' in lines[2] and _leases(engine, "fast") == 1
    writer.close()  # gives the lease back
    await _until(lambda: _leases(engine, "fast") == 0)


async def test_a_silent_engine_fails_the_waits_at_once_and_answers_again() -> None:
    """An engine that stops answering (here: a listener that takes the hello, then says nothing
    until told to) fails a waiting acquire and new ones within the heartbeat timeout; the first
    line it sends again makes it answer again."""
    speak = asyncio.Event()
    silenced: list[bool] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        writer.write(b'{"op": "hello", "protocol": 1}\n')
        await speak.wait()
        writer.write(b'{"op": "pong"}\n')
        await reader.read()

    stub = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = int(stub.sockets[0].getsockname()[1])
    client = await LeaseClient.connect("127.0.0.1", port, SECRET, heartbeat_timeout_s=0.4)
    client.on_silent = lambda: silenced.append(True)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(EngineUnavailable):
        async with asyncio.timeout(5):
            await client.acquire("fast")
    assert 0.4 <= loop.time() - t0 < 2.0 and client.silent and silenced == [True]
    with pytest.raises(EngineUnavailable):
        await client.acquire("fast")  # refused at once while it is silent
    speak.set()
    await _until(lambda: not client.silent)
    await client.close()
    stub.close()


async def test_a_ready_model_is_leased_without_waiting(engine: Engine) -> None:
    """The hot path (Engine.lease_ready): only a loaded model with a live server is leased at
    once; everything else says "ask acquire" (None), which loads, waits or refuses."""
    assert engine.lease_ready("fast") is None  # not loaded yet
    assert engine.lease_ready("ghost") is None  # unknown: acquire rescans and refuses
    engine.release((await engine.acquire("fast")).id)
    lease = engine.lease_ready("fast", keep_alive_s=30.0)
    assert lease is not None and lease.model == "fast" and lease.load_duration_ns == 0
    assert _leases(engine, "fast") == 1
    other = engine.lease_ready("fast")
    assert other is not None and other.id != lease.id  # each grant its own id
    engine.release(lease.id)
    engine.release(other.id)
    assert _leases(engine, "fast") == 0
    server = next(m for m in engine.model_status() if m["model"] == "fast")
    os.kill(server["pid"], signal.SIGKILL)
    child = engine._models["fast"].server
    assert child is not None
    await _until(lambda: not child.alive)  # reaped; its exit watcher may not have run yet
    assert engine.lease_ready("fast") is None  # acquire reloads instead of leasing a corpse


def _lease(lease_id: str) -> Lease:
    return Lease(lease_id, "m", "http://127.0.0.1:9", 0)


async def test_a_grant_cancelled_before_its_waiter_resumes_is_given_back() -> None:
    """A waiter cancelled after its grant arrived but before it resumed (a client giving up at
    that moment) gives the lease back. The interleaving is forced, not waited for: a fake engine
    sends request 1's grant and request 2's progress in one write, so the client's reader takes
    both in one step; request 2's progress listener cancels request 1, whose future already
    holds its grant."""
    frames: asyncio.Queue[FrontFrame] = asyncio.Queue()
    second = asyncio.Event()
    ended = asyncio.Event()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()  # the hello
        writer.write(HelloReply(PROTOCOL).encode())
        acquires = [decode_front_frame(await reader.readline()) for _ in range(2)]
        assert [a.id for a in acquires if isinstance(a, Acquire)] == [1, 2]
        writer.write(Granted(1, _lease("one")).encode() + Progress(2, "loading m").encode())
        await second.wait()
        writer.write(Granted(2, _lease("two")).encode())
        while line := await reader.readline():
            frames.put_nowait(decode_front_frame(line))
        ended.set()

    engine = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    client = await LeaseClient.connect(
        "127.0.0.1", int(engine.sockets[0].getsockname()[1]), SECRET)
    first = asyncio.create_task(client.acquire("m"))
    other = asyncio.create_task(client.acquire("m", on_progress=lambda _: first.cancel()))
    with pytest.raises(asyncio.CancelledError):
        await first
    second.set()
    client.release((await other).id)
    seen: list[FrontFrame] = []
    async with asyncio.timeout(10):
        while Release("two") not in seen:
            seen.append(await frames.get())
    # Lease "one" came back before "two" was released: given back by the cancelled waiter.
    assert seen == [Release("one"), Release("two")]
    await client.close()
    await asyncio.wait_for(ended.wait(), 10)
    engine.close()


async def test_a_grant_pending_when_its_channel_closes_never_becomes_a_lease(
    channel: tuple[Engine, int],
) -> None:
    """The front goes away while its request waits for a load: the engine's wait for it is
    cancelled with the channel, and the load that ends after it leases nothing."""
    engine, port = channel
    client = await LeaseClient.connect("127.0.0.1", port, SECRET)
    waiting = asyncio.create_task(client.acquire("slow"))
    await _until(lambda: any(m["state"] == "loading" for m in engine.model_status()))
    await client.close()
    with pytest.raises(EngineUnavailable):
        await waiting
    await _until(lambda: any(m["state"] == "ready" for m in engine.model_status()))
    assert _leases(engine, "slow") == 0


async def test_a_cancel_after_the_grant_leaves_the_lease_to_its_release_or_its_channel(
    channel: tuple[Engine, int],
) -> None:
    """A Cancel that crosses its grant cannot tell the engine whether the front took the lease:
    the front gives it back (lease_client: _read or the cancelled waiter), and a channel that
    closes gives back all it holds."""
    engine, port = channel
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b'{"op": "hello", "secret": "%s", "protocol": 1}\n' % SECRET.encode())
    writer.write(b'{"op": "acquire", "id": 1, "model": "fast"}\n')
    async with asyncio.timeout(10):
        await reader.readline()  # the hello's answer
        granted = decode_engine_frame(await reader.readline())
    assert isinstance(granted, Granted) and _leases(engine, "fast") == 1
    writer.write(b'{"op": "cancel", "id": 1}\n{"op": "ping"}\n')
    async with asyncio.timeout(10):
        assert await reader.readline() == b'{"op":"pong"}\n'  # the cancel was read before it
    assert _leases(engine, "fast") == 1
    writer.close()
    await _until(lambda: _leases(engine, "fast") == 0)


# ---- lease reuse (front/engines/idle_leases.py) ------------------------------------------------


async def test_the_next_request_takes_the_lease_given_back_without_a_grant(
        channel: tuple[Engine, int]) -> None:  # fmt: skip
    engine, port = channel
    client = await LeaseClient.connect("127.0.0.1", port, SECRET)
    first = await client.acquire("fast")
    assert first.load_duration_ns > 0  # this grant loaded the model
    client.give_back(first)
    again = client.kept_lease("fast", None)
    assert again is not None and again.id == first.id
    assert again.load_duration_ns == 0  # this request loaded nothing
    assert _leases(engine, "fast") == 1  # held all along: no release and no grant in between
    client.give_back(again)
    await asyncio.sleep(LINGER_S)  # idle now: it goes back within the linger
    await _until(lambda: _leases(engine, "fast") == 0)
    assert client.kept_lease("fast", None) is None
    await client.close()


async def test_a_change_of_the_engines_models_gives_kept_leases_back(
        channel: tuple[Engine, int]) -> None:  # fmt: skip
    engine, port = channel
    client = await LeaseClient.connect("127.0.0.1", port, SECRET)
    # Kept far longer than the test: only the engine's State frame can send it back.
    client._idle = IdleLeases(client.release, linger_s=60.0)
    lease = await client.acquire("fast")
    client.give_back(lease)
    assert _leases(engine, "fast") == 1
    other = await client.acquire("slow")  # a load: the engine's models change
    await _until(lambda: _leases(engine, "fast") == 0)
    assert client.kept_lease("fast", None) is None  # never reused past a change
    client.release(other.id)
    await client.close()


# ---- kept leases and the engine's queue (Granted.busy, Wanted) ---------------------------------


@pytest.fixture
async def one_slot(tmp_path: Path) -> AsyncIterator[tuple[Engine, int]]:
    """An engine whose model serves one lease at a time, and its lease channel's port."""
    settings = Settings(home=tmp_path, scan_hf_cache=False, models=[
        OpenAIServerModel.model_validate(fake_model("one", max_concurrency=1))])
    engine = Engine(settings, ModelRegistry.build(settings))
    server = await serve_lease_channel(engine, SECRET)
    yield engine, int(server.sockets[0].getsockname()[1])
    server.close()
    await engine.shutdown()


async def _worker(port: int) -> LeaseClient:
    """A front (a worker of `serve --workers N`) that keeps given-back leases far longer than
    the test: only the engine's frames can make it give one back early. The model is loaded
    and the State frame of that load is in (a State frame gives kept leases back too)."""
    client = await LeaseClient.connect("127.0.0.1", port, SECRET)
    client.release((await client.acquire("one")).id)
    await _until(lambda: (status := client.latest_status()) is not None
                 and any(m.model == "one" and m.state == "ready" for m in status.models))
    client._idle = IdleLeases(client.release, linger_s=60.0, span_s=60.0)
    return client


async def test_a_lease_kept_idle_goes_back_when_another_front_waits_for_the_slot(
        one_slot: tuple[Engine, int]) -> None:  # fmt: skip
    engine, port = one_slot
    a, b = await _worker(port), await _worker(port)
    a.give_back(await a.acquire("one"))  # kept by a: the engine still counts it
    assert _leases(engine, "one") == 1
    # b waits for the one slot: the engine tells a, which gives its kept lease back at once
    # (before: b waited the whole linger, a minute here)
    granted = await asyncio.wait_for(b.acquire("one"), 10)
    assert a.kept_lease("one", None) is None
    b.release(granted.id)
    await a.close()
    await b.close()


async def test_a_lease_in_use_goes_back_at_its_end_while_another_front_waits(
        one_slot: tuple[Engine, int]) -> None:  # fmt: skip
    engine, port = one_slot
    a, b, c = await _worker(port), await _worker(port), await _worker(port)
    held = await a.acquire("one")
    waiting_b = asyncio.create_task(b.acquire("one"))
    await _until(lambda: engine.slots_wanted("one"))
    waiting_c = asyncio.create_task(c.acquire("one"))
    await _until(lambda: _waiting(engine, "one") == 2)
    a.give_back(held)  # its request ended while b and c wait: released, not kept
    to_b = await asyncio.wait_for(waiting_b, 10)
    assert a.kept_lease("one", None) is None
    # b's grant said others (c) still wait: b gives it back at its end too, and c gets it
    b.give_back(to_b)
    to_c = await asyncio.wait_for(waiting_c, 10)
    assert b.kept_lease("one", None) is None
    # nobody waits now: c keeps its lease for its next request, as before
    c.give_back(to_c)
    again = c.kept_lease("one", None)
    assert again is not None and again.id == to_c.id
    c.release(again.id)
    for client in (a, b, c):
        await client.close()


def _waiting(engine: Engine, model: str) -> int:
    rt = engine._models.get(model)
    return 0 if rt is None else rt.slots.waiting
