"""A backend's per-request word on speculative decoding reaches the client (issue 19 point 7):
the transformers engine answers a model with a `draft_model` it cannot use with
`X-Modelyard-Speculative: off; reason=…`, and the front passes that header on, streamed or not,
in every API. Here a fake backend sets the header, as that engine's server does."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from tests.integration.harness import config, module_server
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

NOTE = 'off; reason="continuous batching decodes without a draft"'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    models = [fake_model("drafted", "--response-header", f"X-Modelyard-Speculative:{NOTE}"),
              fake_model("plain")]
    with module_server(tmp_path_factory, config(*models)) as s:
        yield s


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat", "/v1/messages"])
@pytest.mark.parametrize("stream", [False, True])
def test_the_speculative_note_is_passed_on(server: Server, path: str, stream: bool) -> None:
    body = {"model": "drafted", "stream": stream, "max_tokens": 8,
            "messages": [{"role": "user", "content": "hello there"}]}
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers.get("x-modelyard-speculative") == NOTE


def test_no_note_without_one(server: Server) -> None:
    body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert "x-modelyard-speculative" not in r.headers
