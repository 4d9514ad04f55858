"""A model's backend takes only its load's key (DESIGN.md §3.12, issue 20), through a real
`modelyard serve` and the fake llama-server (keyed as llama-server is, `--api-key-file`): a
request straight to its URL without the key is a 401, with it an answer; through the front the
key travels in the lease; the key file is private and gone once the model unloads."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.integration.harness import HELLO, config, model_status, module_server
from tests.support import Server, fake_model

from modelyard.engine.backends.keys import key_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with module_server(tmp_path_factory, config(fake_model("m"))) as s:
        yield s


def chat(server: Server, **headers: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", timeout=30, headers=headers,
                      json={"model": "m", "messages": HELLO, "max_tokens": 3})


def key_files(server: Server) -> list[Path]:
    where = key_dir(server.home)
    return sorted(where.iterdir()) if where.is_dir() else []


def test_the_backend_wants_the_loads_key_which_the_front_sends(server: Server) -> None:
    # The first request loads the model; the second takes the hot path (sent before the grant,
    # to the upstream and with the key of the last one).
    for _ in range(2):
        r = chat(server)
        assert r.status_code == 200, r.text
    # A client's own credentials never reach the backend: the relay builds its headers.
    r = chat(server, authorization="Bearer not-the-backends-key")
    assert r.status_code == 200, r.text
    found = model_status(server, "m")
    assert found is not None and found["state"] == "ready"
    url = found["upstream"] + "/v1/chat/completions"
    body = {"model": "m", "messages": HELLO, "max_tokens": 1}
    assert httpx.post(url, json=body, timeout=10).status_code == 401
    wrong = httpx.post(url, json=body, timeout=10, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "authentication_error"
    [path] = key_files(server)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = path.read_text().strip()
    assert len(key) >= 43
    right = httpx.post(url, json=body, timeout=10, headers={"Authorization": f"Bearer {key}"})
    assert right.status_code == 200, right.text
    # Health stays open: what readiness probes ask.
    assert httpx.get(found["upstream"] + "/health", timeout=10).status_code == 200


def test_the_key_file_goes_with_the_load(server: Server) -> None:
    assert chat(server).status_code == 200
    assert len(key_files(server)) == 1
    r = httpx.post(server.url + "/api/generate", json={"model": "m", "keep_alive": 0},
                   timeout=30)
    assert r.json()["done_reason"] == "unload"
    assert key_files(server) == []  # the unload answers once the server has stopped
    # The next load has a new key (and file).
    assert chat(server).status_code == 200
    assert len(key_files(server)) == 1
