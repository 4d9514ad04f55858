"""A model's server can only be told a port number (llama-server takes no inherited socket), so
the port free when the engine chose it may be taken before the server binds it. The engine then
starts the server once more on another port instead of failing the load. Real processes: the
fake llama-server, and a socket this test holds on the port it makes the engine choose first."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from tests.support import fake_model

from modelyard.config import OpenAIServerModel, Settings
from modelyard.engine.backends import openai_server
from modelyard.engine.backends.openai_server import ChildServer
from modelyard.errors import ModelLoadFailed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
def taken() -> Iterator[int]:
    """A loopback port some other process holds for the whole test."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


async def test_a_server_whose_port_was_taken_starts_on_another(
    tmp_path: Path, taken: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    free = iter([taken])  # the first choice is the taken port; the next ones are the kernel's
    real_free_port = openai_server.free_port
    monkeypatch.setattr(openai_server, "free_port",
                        lambda host="127.0.0.1": next(free, None) or real_free_port(host))
    server = ChildServer(OpenAIServerModel(**fake_model("m")), Settings(home=tmp_path))
    assert server.port == taken
    try:
        await server.start()
        assert server.port != taken and str(server.port) in server.process.argv
        async with aiohttp.ClientSession() as http, http.get(server.url + "/health") as r:
            assert r.status == 200
    finally:
        await server.stop()


async def test_a_server_failing_for_another_reason_is_not_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawned: list[int] = []
    server = ChildServer(OpenAIServerModel(**fake_model("m", "--crash-on-load")),
                         Settings(home=tmp_path))
    with pytest.raises(ModelLoadFailed):
        await server.start(on_spawn=spawned.append)
    assert len(spawned) == 1
