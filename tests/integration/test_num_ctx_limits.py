"""Ollama's `num_ctx` rationed (issue 31, items 4 and 5), on a real `modelyard serve` with fake
llama-server processes: a context no server of the model could have is a 400 (over the GGUF's
trained context, or over the bound when the file does not say), not the engine's 503; a larger
context is a variant rounded up to a power of two, a running one that fits is reused, at most
`max_context_variants` run per model (then 429 context_variants_full), and the caller's
`max_num_ctx` limit decides who may ask beyond the served context (admins always may).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tests.integration.harness import HELLO, config, model_status, module_server
from tests.support import Server, fake_model, poll, tiny_gguf

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SERVED = 256  # every model here is served with this context


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    files = tmp_path_factory.mktemp("ggufs")
    trained = fake_model("trained", ctx_size=SERVED)  # a GGUF that says 2048 (tiny_gguf)
    trained.update(backend="llamacpp", path=str(tiny_gguf(files / "trained.gguf")))
    models = [trained, *(fake_model(m, ctx_size=SERVED) for m in ("wide", "rounds", "ruled"))]
    with module_server(tmp_path_factory, config(*models, max_context_variants=2)) as s:
        yield s


def chat(server: Server, model: str, num_ctx: Any, headers: dict[str, str] | None = None,
         path: str = "/api/chat") -> httpx.Response:
    body: dict[str, Any] = {"model": model, "stream": False, "options": {"num_ctx": num_ctx}}
    body.update({"prompt": "hi"} if path == "/api/generate" else {"messages": HELLO})
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30)


def variants(server: Server, model: str) -> list[str]:
    found = []
    for size in (256, 300, 512, 600, 768, 1024, 1280, 2048, 4096):
        status = model_status(server, f"{model}@ctx{size}")
        if status is not None and status["state"] in ("ready", "loading"):
            found.append(f"{model}@ctx{size}")
    return found


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
@pytest.mark.parametrize("num_ctx", [4096, 1_000_000_000])
def test_num_ctx_over_the_trained_context_is_a_400(server: Server, path: str,
                                                   num_ctx: int) -> None:
    r = chat(server, "trained", num_ctx, path=path)
    assert r.status_code == 400, r.text
    assert f"{num_ctx} is more than the 2048 tokens" in r.json()["error"]
    assert variants(server, "trained") == []  # nothing started


def test_num_ctx_up_to_the_trained_context_runs_clamped_to_it(server: Server) -> None:
    r = chat(server, "trained", 1500)  # a power of two up would be 2048: the trained context
    assert r.status_code == 200, r.text
    assert variants(server, "trained") == ["trained@ctx2048"]


def test_num_ctx_beyond_the_bound_of_a_model_that_does_not_say_is_a_400(server: Server) -> None:
    r = chat(server, "wide", 1_000_000_000)  # was: a load refused with 503 "needs … GiB"
    assert r.status_code == 400, r.text
    assert "more than the 1048576 tokens" in r.json()["error"]
    assert variants(server, "wide") == []


@pytest.mark.parametrize("num_ctx", [-1, 0, 1.5, "8k", True])
def test_num_ctx_that_is_not_a_positive_integer_is_a_400(server: Server, num_ctx: Any) -> None:
    r = chat(server, "wide", num_ctx)
    assert r.status_code == 400 and "num_ctx" in r.json()["error"], r.text


def test_variants_round_to_powers_of_two_reuse_what_runs_and_are_capped(server: Server) -> None:
    assert chat(server, "rounds", 300).status_code == 200
    assert chat(server, "rounds", 600).status_code == 200
    assert poll(lambda: variants(server, "rounds") == ["rounds@ctx512", "rounds@ctx1024"],
                what="both variants running")
    # The cap (2) is reached and none fits 1500: a 429, and no third server.
    refused = chat(server, "rounds", 1500)
    assert refused.status_code == 429, refused.text
    message = refused.json()["error"]
    assert "max_context_variants" in message and "512, 1024" in message
    # What fits a running variant is served by the smallest that does, at the cap or not.
    for num_ctx in (700, 400, 1024):
        assert chat(server, "rounds", num_ctx).status_code == 200
    assert variants(server, "rounds") == ["rounds@ctx512", "rounds@ctx1024"]
    # Within the served context: the model as it is, whatever runs.
    assert chat(server, "rounds", SERVED).status_code == 200
    assert model_status(server, "rounds") is not None


def test_max_num_ctx_decides_who_may_ask_beyond_the_served_context(server: Server) -> None:
    admin = server.admin_headers
    r = httpx.post(server.url + "/admin/users", headers=admin, timeout=10,
                   json={"name": "bob", "password": "a-long-password"})
    assert r.status_code == 201, r.text
    r = httpx.post(server.url + "/tokens", headers=admin, timeout=10,
                   json={"name": "t", "owner": "bob"})
    assert r.status_code == 201, r.text
    bob = {"Authorization": f"Bearer {r.json()['token']}"}
    r = httpx.put(server.url + "/admin/limits/user:bob", headers=admin, timeout=10,
                  json={"max_num_ctx": 512})
    assert r.status_code == 200 and r.json()["max_num_ctx"] == 512, r.text
    listed = httpx.get(server.url + "/admin/limits", headers=admin, timeout=10).json()
    assert [x["max_num_ctx"] for x in listed["limits"] if x["subject"] == "user:bob"] == [512]

    refused = chat(server, "ruled", 1000, bob)
    assert refused.status_code == 403, refused.text
    assert "max_num_ctx limit (512)" in refused.json()["error"]
    assert variants(server, "ruled") == []
    assert chat(server, "ruled", SERVED, bob).status_code == 200  # the served context: always
    assert chat(server, "ruled", 500, bob).status_code == 200  # within the limit
    assert chat(server, "ruled", 1000, admin).status_code == 200  # admins have no limit
    assert variants(server, "ruled") == ["ruled@ctx512", "ruled@ctx1024"]


def test_a_modelfile_num_ctx_over_the_trained_context_is_a_400(server: Server) -> None:
    r = httpx.post(server.url + "/api/create", headers=server.admin_headers, timeout=30, json={
        "model": "too-wide", "modelfile": "FROM trained\nPARAMETER num_ctx 100000\n",
        "stream": False})
    assert r.status_code == 400, r.text
    assert "100000 is more than the 2048 tokens" in r.json()["error"]
