"""A relay that opens as its request is abandoned is closed, and its lease goes back (issue 31):
a request cancelled while its relay opens (a shutdown past its grace, an enclosing wait whose
client left), and a swap-progress stream whose client left before the stream began (its body
never started, so its own `finally` never ran while the relay went on opening).

The front is `create_app` served in this process, so the test opens relays through its real
dispatcher; the engine is a real process, its lease channel real, the model the fake backend.
Each interleaving is forced, not waited for."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from starlette.types import Message
from tests.integration.harness import HELLO, config, served_in_process
from tests.support import fake_model

from modelyard.config import load_settings
from modelyard.front.app import create_app
from modelyard.front.dispatch.dispatcher import Dispatcher
from modelyard.front.dispatch.relay import Relay
from modelyard.front.dispatch.swap_progress import open_for_stream, relay_or_progress
from modelyard.front.engines.provider import LocalEngines

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

PAYLOAD = orjson.dumps({"model": "m", "messages": HELLO, "max_tokens": 2, "stream": True})
PATH = "/v1/chat/completions"


@pytest.fixture
async def dispatch(tmp_path: Path) -> AsyncIterator[Dispatcher]:
    config_file = tmp_path / "config.yaml"
    config_file.write_bytes(orjson.dumps(config(fake_model("m", "--load-time-s", "0.5"))))
    settings = load_settings(config_file, home=tmp_path)
    app = create_app(settings, provider=LocalEngines(settings, config_file=config_file),
                     config_file=config_file)
    async with served_in_process(app):
        yield app.state.front.dispatch


async def leases(dispatch: Dispatcher) -> int:
    status = await dispatch.engines[0].status()
    return sum(m.leases for m in status.models)


async def no_lease_left(dispatch: Dispatcher) -> None:
    """Until the engine holds no lease (its release is a frame on the channel): 10 s at most."""
    async with asyncio.timeout(10):
        while await leases(dispatch):
            await asyncio.sleep(0.05)


def opening(dispatch: Dispatcher, then: Callable[[], Any] = lambda: None
            ) -> Callable[[Callable[[str], None] | None], Any]:
    async def open_relay(say: Callable[[str], None] | None) -> Relay:
        relay = await dispatch.open_relay("m", PATH, PAYLOAD, on_progress=say)
        then()  # in the step that opened it: before anyone waiting for it resumes
        return relay

    return open_relay


async def test_a_request_cancelled_as_its_relay_opens_gives_the_lease_back(
    dispatch: Dispatcher,
) -> None:
    """A ready model (the relay opens without a word of progress)."""
    (await dispatch.open_relay("m", PATH, PAYLOAD)).close()
    await no_lease_left(dispatch)
    request: asyncio.Task[Any] | None = None

    def cancel_the_request() -> None:
        assert request is not None
        request.cancel()

    request = asyncio.create_task(relay_or_progress(opening(dispatch, cancel_the_request)))
    with pytest.raises(asyncio.CancelledError):
        await request
    await no_lease_left(dispatch)


async def test_a_progress_stream_left_before_it_began_gives_the_lease_back(
    dispatch: Dispatcher,
) -> None:
    """A cold model: the relay waits for the load (progress heard), so the response is a
    progress stream; its client stopped reading and then left, so the stream ended before its
    body began. The relay then opens for nobody."""

    async def body(relay: Relay) -> AsyncIterator[bytes]:
        yield b""

    response = await open_for_stream(
        opening(dispatch), enabled=True, render_progress=str.encode,
        render_error=lambda exc: b"", body=body, media_type="text/event-stream")

    async def gone() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        # The client does not read: the transport's buffer is full and the first write waits
        # (uvicorn's flow control), until the disconnect ends the response there.
        await asyncio.Event().wait()

    await response({"type": "http", "asgi": {"spec_version": "2.3"}}, gone, send)
    # The load goes on (others may want it) and ends ready; the relay must not hold it.
    async with asyncio.timeout(20):
        while await state(dispatch) != "ready":
            await asyncio.sleep(0.05)
    await no_lease_left(dispatch)


async def state(dispatch: Dispatcher) -> str | None:
    status = await dispatch.engines[0].status()
    return next((m.state for m in status.models if m.model == "m"), None)
