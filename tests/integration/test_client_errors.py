"""A client's mistakes are 4xx with a code, never the backend's 500 passed on (issue 15, item 9).

Through a real `modelyard serve` and fake llama-server processes that answer these mistakes as
llama-server does, with a 500 (tests/fakes/fake_backend.py: `chat_fault`): an image for a GGUF
model without its projector is `vision_unsupported` before anything loads, a malformed image or
`tools` is `invalid_request` naming the field, in each API's own error shape; a body the client
cut short is a 499 in the metrics, with no traceback in the log, and the server keeps serving.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.integration.harness import HELLO, config, module_server, starts
from tests.support import Server, fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

# A 1x1 grey PNG.
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAAAAAA6fptVAAAACklEQVR4nGNgAAAAAgABSK+kcQAAAABJRU5ErkJggg=="
PATHS = {"openai": "/v1/chat/completions", "ollama": "/api/chat", "native": "/chat"}


def gguf_model(model_id: str, files: Path, *, projector: bool = False) -> dict[str, Any]:
    """A llama.cpp model (so modelyard decides what it can read from its spec) whose argv runs
    the fake llama-server; with a projector its argv passes `--mmproj` as the default one does."""
    weights = files / f"{model_id}.gguf"
    weights.write_bytes(b"GGUF" + b"\x00" * 20)
    spec = fake_model(model_id, "--start-log", str(files / f"{model_id}.starts"))
    spec.update(backend="llamacpp", path=str(weights))
    if projector:
        (files / f"mmproj-{model_id}.gguf").write_bytes(b"GGUF" + b"\x00" * 20)
        spec.update(mmproj=str(files / f"mmproj-{model_id}.gguf"))
        spec["argv"] = [*spec["argv"], "--mmproj", "$mmproj"]
    return spec


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, files: Path) -> Iterator[Server]:
    models = [gguf_model("text", files), gguf_model("eyes", files, projector=True),
              gguf_model("plain", files)]
    with module_server(tmp_path_factory, config(*models)) as s:
        yield s


def image_message(api: str, image: str) -> dict[str, Any]:
    """A user message carrying one image, as each API sends it."""
    if api == "ollama":
        return {"role": "user", "content": "What is this?", "images": [image]}
    url = f"data:image/png;base64,{image}"
    return {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                        {"type": "image_url", "image_url": {"url": url}}]}


def post(server: Server, api: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + PATHS[api], json={"stream": False, **body}, timeout=30)


def error_of(api: str, r: httpx.Response) -> tuple[str, str | None, str]:
    """(code, param, message) of an error in the API's own shape (Ollama's has only a message,
    which names the field)."""
    body = r.json()
    if api == "openai":
        err = body["error"]
        return str(err["code"]), err["param"], str(err["message"])
    if api == "ollama":
        assert set(body) == {"error"}, body
        return "", None, str(body["error"])
    return str(body["error"]), body.get("param"), str(body["message"])


@pytest.mark.parametrize("api", ["openai", "ollama", "native"])
def test_an_image_for_a_text_model_is_vision_unsupported_and_loads_nothing(
    server: Server, files: Path, api: str
) -> None:
    r = post(server, api, {"model": "text", "messages": [image_message(api, PNG)]})
    assert r.status_code == 400, r.text
    code, _, message = error_of(api, r)
    assert code in ("vision_unsupported", "") and "cannot read images" in message
    assert starts(files / "text.starts") == []  # refused before a lease: nothing loaded


def test_ollama_generate_with_images_for_a_text_model_is_vision_unsupported(
    server: Server, files: Path
) -> None:
    r = httpx.post(server.url + "/api/generate", timeout=30, json={
        "model": "text", "prompt": "What is this?", "images": [PNG], "stream": False})
    assert r.status_code == 400, r.text
    assert "cannot read images" in r.json()["error"]
    assert starts(files / "text.starts") == []


def test_show_lists_the_vision_capability(server: Server) -> None:
    def caps(model: str) -> list[str]:
        r = httpx.post(server.url + "/api/show", json={"model": model}, timeout=30)
        assert r.status_code == 200, r.text
        return list(r.json()["capabilities"])

    assert "vision" in caps("eyes") and "vision" not in caps("text")


@pytest.mark.parametrize("api", ["openai", "ollama", "native"])
def test_an_image_for_a_vision_model_is_answered(server: Server, api: str) -> None:
    r = post(server, api, {"model": "eyes", "messages": [image_message(api, PNG)]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("api", ["openai", "ollama", "native"])
@pytest.mark.parametrize("image", ["", "not base64!"])
def test_a_malformed_image_is_invalid_request_naming_it(
    server: Server, api: str, image: str
) -> None:
    r = post(server, api, {"model": "eyes", "messages": [image_message(api, image)]})
    assert r.status_code == 400, r.text
    code, param, message = error_of(api, r)
    field = "messages.0.images.0" if api == "ollama" else "messages.0.content.1.image_url.url"
    assert code in ("invalid_request", "") and field in message
    assert param in (field, None)


def test_ollama_generate_with_an_empty_image_is_invalid_request(server: Server) -> None:
    r = httpx.post(server.url + "/api/generate", timeout=30, json={
        "model": "eyes", "prompt": "What is this?", "images": [""], "stream": False})
    assert r.status_code == 400, r.text
    assert "images.0" in r.json()["error"]


@pytest.mark.parametrize("api", ["openai", "ollama", "native"])
def test_tools_that_are_not_a_list_are_invalid_request(server: Server, api: str) -> None:
    r = post(server, api, {"model": "plain", "messages": HELLO, "tools": "x"})
    assert r.status_code == 400, r.text
    code, param, message = error_of(api, r)
    assert code in ("invalid_request", "") and message.startswith("tools:")
    assert param in ("tools", None)



@pytest.mark.parametrize("api", ["openai", "ollama", "native"])
@pytest.mark.parametrize("kind", ["frob", "web_search", "file_search"])
def test_a_tool_type_modelyard_does_not_run_is_tool_type_unsupported(
    server: Server, api: str, kind: str
) -> None:
    """Relayed, llama-server answers it with a 500: refused in the front, naming the type."""
    r = post(server, api, {"model": "plain", "messages": HELLO, "tools": [{"type": kind}]})
    assert r.status_code == 400, r.text
    code, param, message = error_of(api, r)
    assert code in ("tool_type_unsupported", "") and repr(kind) in message
    assert "tools.0.type" in message and param in ("tools.0.type", None)


def test_an_mcp_tool_is_refused_where_no_tool_loop_runs(server: Server) -> None:
    """Native /chat runs no MCP tool loop: its `mcp` entry would be relayed as it is."""
    tools = [{"type": "mcp", "server": "time"}]
    r = post(server, "native", {"model": "plain", "messages": HELLO, "tools": tools})
    assert r.status_code == 400, r.text
    assert error_of("native", r)[:2] == ("tool_type_unsupported", "tools.0.type")


@pytest.mark.parametrize("api", ["openai", "ollama"])
def test_an_mcp_tool_without_a_server_is_invalid_request(server: Server, api: str) -> None:
    r = post(server, api, {"model": "plain", "messages": HELLO, "tools": [{"type": "mcp"}]})
    assert r.status_code == 400, r.text
    code, _, message = error_of(api, r)
    assert code in ("invalid_request", "") and message.startswith("tools.0:")


def test_hosted_tools_of_the_responses_and_messages_apis_are_tool_type_unsupported(
    server: Server
) -> None:
    r = httpx.post(server.url + "/v1/responses", timeout=30, json={
        "model": "plain", "input": "hi", "tools": [{"type": "web_search"}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("tool_type_unsupported", "tools.0.type")
    assert "'web_search'" in err["message"]
    r = httpx.post(server.url + "/v1/messages", timeout=30, json={
        "model": "plain", "max_tokens": 8, "messages": HELLO,
        "tools": [{"type": "web_search_20250305", "name": "web_search"}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "'web_search_20250305'" in r.json()["error"]["message"]

def scrape(server: Server) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    r = httpx.get(server.url + "/metrics", headers=server.admin_headers, timeout=10)
    assert r.status_code == 200, r.text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def requests_by_status(server: Server, api: str) -> dict[str, float]:
    return {dict(labels)["status"]: v for (name, labels), v in scrape(server).items()
            if name == "modelyard_requests_total" and dict(labels)["api"] == api}


def test_a_body_cut_short_by_the_client_is_a_499_without_a_traceback(server: Server) -> None:
    before = requests_by_status(server, "openai")
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head.encode() + b'{"model": "plain", "messages": [' + b" " * 1000)
    # The front counts the request once it has seen the connection go.
    after = poll(lambda: (now := requests_by_status(server, "openai")) != before and now,
                 what="the cut request counted")
    added = {status: n - before.get(status, 0) for status, n in after.items()
             if n != before.get(status, 0)}
    assert added == {"499": 1}
    log = server.output()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    r = post(server, "openai", {"model": "plain", "messages": HELLO})  # and it still serves
    assert r.status_code == 200, r.text
