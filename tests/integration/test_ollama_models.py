"""Ollama's model-management side as its clients read it, on a real `modelyard serve` with fake
backends and tiny real GGUF files: tagged names, /api/ps, /api/show capabilities, /api/create
and /api/blobs, /api/push, deleting an alias, `/` for non-browsers, and CORS defaults.

One server is shared by the module; each test that changes the catalog uses names of its own.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from langchain_ollama import ChatOllama
from tests.integration.harness import HELLO, config, module_server
from tests.support import Server, fake_model, tiny_gguf

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
MAX_BODY = 64 * 1024

TOOLS_AND_THINKING = (
    "{% if tools %}{{ tools }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    "{% if enable_thinking %}<think>{% endif %}"
)



@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ggufs")
    return {
        "thinker": tiny_gguf(root / "thinker.gguf", "qwen3", TOOLS_AND_THINKING,
                             {"tokenizer.ggml.fim_pre_token_id": 1}),
        "plain": tiny_gguf(root / "plain.gguf", "llama", "{% for m in messages %}{% endfor %}"),
        "embedder": tiny_gguf(root / "embedder.gguf", "bert", None,
                              {"bert.pooling_type": 1}),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, ggufs: dict[str, Path]) -> Iterator[Server]:
    models = [
        fake_model("m1"),
        fake_model("pinned"),
        fake_model("del-base"),
        fake_model("create-base"),
        fake_model("org/tagged:Q4_K_M"),
        *({"id": name, "backend": "llamacpp", "path": str(path)} for name, path in ggufs.items()),
    ]
    # A small body limit: an admin's blob upload (a whole model file) is not held to it.
    with module_server(tmp_path_factory, config(*models, max_body_bytes=MAX_BODY)) as s:
        yield s


def post(server: Server, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30, **kw)


def admin(server: Server, path: str, body: Any) -> httpx.Response:
    """Model management is an admin's (the CLI's token)."""
    return post(server, path, body, headers=server.admin_headers)


def tags(server: Server) -> set[str]:
    return {t["name"] for t in httpx.get(server.url + "/api/tags", timeout=10).json()["models"]}


# --- tagged names -------------------------------------------------------------------------------


def test_tags_lists_tagged_names_and_every_api_takes_both_forms(server: Server) -> None:
    listed = tags(server)
    assert {"m1:latest", "thinker:latest", "org/tagged:Q4_K_M"} <= listed
    assert "m1" not in listed and "org/tagged:Q4_K_M:latest" not in listed
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    for name in ("m1", "m1:latest"):
        done = client.chat.completions.create(model=name, messages=HELLO, max_tokens=3)
        assert done.choices[0].message.content
        r = post(server, "/api/chat", {"model": name, "messages": HELLO, "stream": False})
        assert r.status_code == 200, r.text
        r = post(server, "/chat", {"model": name, "messages": HELLO})
        assert r.status_code == 200, r.text
        assert post(server, "/api/show", {"model": name}).status_code == 200


def test_chat_ollama_validates_the_model_on_init(server: Server) -> None:
    for name in ("m1", "m1:latest"):
        llm = ChatOllama(model=name, base_url=server.url, validate_model_on_init=True,
                         num_predict=3)
        assert llm.invoke("hi").content
    with pytest.raises(ValueError, match="not found"):
        ChatOllama(model="nope", base_url=server.url, validate_model_on_init=True)


# --- /api/ps ------------------------------------------------------------------------------------


def test_ps_reads_as_ollama_s_clients_read_it(server: Server) -> None:
    # keep_alive -1: kept loaded forever.
    r = post(server, "/api/generate", {"model": "pinned", "keep_alive": -1})
    assert r.status_code == 200, r.text
    running = {m["name"]: m for m in httpx.get(server.url + "/api/ps", timeout=10)
               .json()["models"]}
    pinned = running["pinned:latest"]
    assert not pinned["expires_at"].startswith("0001")
    assert int(pinned["expires_at"][:4]) > 2100  # far ahead, as Ollama gives it
    assert pinned["size_vram"] == 0  # a CPU-only engine: nothing on a GPU
    assert 0 <= pinned["size_vram"] <= pinned["size"]
    assert pinned["context_length"] == 4096  # default_ctx_size: what its server was given
    assert {"digest", "details", "model"} <= set(pinned)
    seen = ollama.Client(host=server.url).ps().models
    model = next(m for m in seen if m.model == "pinned:latest")
    assert model.size_vram == 0 and model.expires_at is not None
    assert model.expires_at.year > 2100


# --- /api/show ----------------------------------------------------------------------------------


def test_show_capabilities_come_from_the_gguf_metadata_and_template(server: Server) -> None:
    def show(name: str) -> dict[str, Any]:
        r = post(server, "/api/show", {"model": name})
        assert r.status_code == 200, r.text
        return dict(r.json())

    thinker = show("thinker")
    assert set(thinker["capabilities"]) == {"completion", "tools", "thinking", "insert"}
    assert thinker["model_info"]["qwen3.context_length"] == 2048
    assert thinker["model_info"]["general.architecture"] == "qwen3"
    assert thinker["details"]["family"] == "qwen3"
    assert show("plain")["capabilities"] == ["completion"]
    assert show("embedder")["capabilities"] == ["embedding"]
    shown = ollama.Client(host=server.url).show("thinker:latest")
    assert shown.capabilities is not None and "thinking" in shown.capabilities


# --- /api/copy and /api/delete ------------------------------------------------------------------


def test_deleting_a_copy_deletes_only_the_copy(server: Server) -> None:
    r = admin(server, "/api/copy", {"source": "del-base", "destination": "del-copy"})
    assert r.status_code == 200, r.text
    assert {"del-base:latest", "del-copy:latest"} <= tags(server)
    r = admin(server, "/api/delete", {"model": "del-copy:latest"})
    assert r.status_code == 200, r.text
    listed = tags(server)
    assert "del-copy:latest" not in listed
    assert "del-base:latest" in listed
    r = post(server, "/api/chat", {"model": "del-base", "messages": HELLO, "stream": False})
    assert r.status_code == 200, r.text


# --- /api/create, /api/blobs, /api/push ---------------------------------------------------------


def test_create_from_a_modelfile_makes_a_preset_and_delete_removes_only_it(
        server: Server) -> None:
    modelfile = ('FROM create-base:latest\nPARAMETER num_predict 3\nPARAMETER stop "<|end|>"\n'
                 'SYSTEM """You are\nterse."""\nMESSAGE user hi\nMESSAGE assistant hello\n'
                 'TEMPLATE {{ .Prompt }}\n')
    body = {"model": "terse", "modelfile": modelfile}
    with httpx.stream("POST", server.url + "/api/create", timeout=30,
                      headers=server.admin_headers, json=body) as r:
        assert r.status_code == 200
        lines = [httpx.Response(200, content=line).json() for line in r.iter_lines() if line]
    assert lines[-1] == {"status": "success"}
    assert "terse:latest" in tags(server)
    shown = post(server, "/api/show", {"model": "terse"}).json()
    assert shown["system"] == "You are\nterse."
    assert shown["template"] == "{{ .Prompt }}"
    assert shown["details"]["parent_model"] == "create-base"
    assert "num_predict" in shown["parameters"] and "max_tokens" not in shown["parameters"]
    assert "PARAMETER num_predict 3" in shown["modelfile"]  # Ollama's name, as it was written
    assert shown["messages"] == [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "hello"}]
    # The preset's num_predict reaches the backend: 3 tokens, where the base answers more.
    r = post(server, "/api/chat", {"model": "terse", "messages": HELLO, "stream": False})
    assert r.status_code == 200, r.text
    assert r.json()["eval_count"] == 3
    base = post(server, "/api/chat", {"model": "create-base", "messages": HELLO,
                                      "stream": False}).json()
    assert base["eval_count"] > 3

    # The structured form, through the official client.
    client = ollama.Client(host=server.url, headers=server.admin_headers)
    done = client.create(model="terse2", from_="create-base", system="Be brief.",
                         parameters={"num_predict": 2}, stream=False)
    assert done.status == "success"
    assert post(server, "/api/chat", {"model": "terse2", "messages": HELLO, "stream": False}
                ).json()["eval_count"] == 2

    for name in ("terse", "terse2"):
        assert admin(server, "/api/delete", {"model": name}).status_code == 200
    listed = tags(server)
    assert "terse:latest" not in listed and "terse2:latest" not in listed
    assert "create-base:latest" in listed


@pytest.mark.parametrize(("body", "needle"), [
    ({"model": "x", "modelfile": "FROM m1\nADAPTER ./lora.gguf\n"}, "ADAPTER"),
    ({"model": "x", "modelfile": "FROM m1\nPARAMETER mirostat 1\n"}, "mirostat"),
    ({"model": "x", "modelfile": "PARAMETER temperature 1\n"}, "FROM"),
    ({"model": "x", "modelfile": "FROM no-such-model\n"}, "no-such-model"),
    ({"model": "x", "modelfile": "FROM m1\nBOGUS 1\n"}, "BOGUS"),
    ({"model": "m1", "from": "create-base"}, "already"),
    ({"model": "x", "from": "@sha256:" + "0" * 64}, "upload"),
    # Once 500s with the connection reset (issue 31): each a 400 naming the line or field.
    ({"model": "x", "modelfile": 'FROM m1\nPARAMETER stop "a"b"\n'}, "line 2: unbalanced"),
    ({"model": "x", "modelfile": 'FROM m1\nSYSTEM """open\n'}, "line 2"),
    ({"model": "x", "modelfile": "FROM m1\nPARAMETER seed 1" + "0" * 30}, "line 2"),
    ({"model": "x", "from": ["m1"]}, "from"),
    ({"model": "x", "from": "m1", "parameters": {"temperature": "hot"}}, "temperature"),
    ({"model": "x", "from": "m1", "parameters": {"stop": [1]}}, "stop"),
    ({"model": "x", "from": "m1", "parameters": "hot"}, "parameters"),
])
def test_create_refuses_what_it_cannot_do_with_a_400_in_ollama_s_shape(
        server: Server, body: dict[str, Any], needle: str) -> None:
    r = admin(server, "/api/create", {**body, "stream": False})
    assert r.status_code in (400, 404), r.text
    assert needle in r.json()["error"]
    assert "x:latest" not in tags(server)


def test_blobs_are_checked_stored_owner_only_and_a_model_can_be_made_from_one(
        server: Server, ggufs: dict[str, Path]) -> None:
    data = ggufs["plain"].read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    url = f"{server.url}/api/blobs/{digest}"
    auth = server.admin_headers
    assert httpx.head(url, timeout=10, headers=auth).status_code == 404
    wrong = f"{server.url}/api/blobs/sha256:{'1' * 64}"
    r = httpx.post(wrong, content=data, timeout=10, headers=auth)
    assert r.status_code == 400 and "digest mismatch" in r.json()["error"]
    assert httpx.head(wrong, timeout=10, headers=auth).status_code == 404
    assert httpx.post(f"{server.url}/api/blobs/md5:abc", content=b"x", timeout=10,
                      headers=auth).status_code == 400
    assert httpx.post(url, content=data, timeout=10, headers=auth).status_code == 201
    assert httpx.head(url, timeout=10, headers=auth).status_code == 200
    blob = server.home / "blobs" / ("sha256-" + digest.removeprefix("sha256:"))
    assert stat.S_IMODE(blob.stat().st_mode) == 0o600
    assert blob.read_bytes() == data
    names = {b.name for b in (server.home / "blobs").iterdir()}
    assert "sha256-" + "1" * 64 not in names  # the mismatched upload left nothing
    assert not any(n.endswith(".part") for n in names)

    r = admin(server, "/api/create", {"model": "from-blob", "files": {"plain.gguf": digest},
                                     "stream": False})
    assert r.status_code == 200, r.text
    assert "from-blob:latest" in tags(server)
    shown = post(server, "/api/show", {"model": "from-blob"}).json()
    assert shown["details"]["family"] == "llama" and shown["details"]["format"] == "gguf"
    assert admin(server, "/api/delete", {"model": "from-blob"}).status_code == 200
    assert "from-blob:latest" not in tags(server)


def test_an_admin_s_blob_upload_is_not_held_to_max_body_bytes(server: Server) -> None:
    data = bytes(range(256)) * (3 * MAX_BODY // 256)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    r = httpx.post(f"{server.url}/api/blobs/{digest}", content=data, timeout=30,
                   headers=server.admin_headers)
    assert r.status_code == 201, r.text
    r = httpx.post(server.url + "/api/show", content=b" " * (2 * MAX_BODY), timeout=30)
    assert r.status_code == 413  # any other body still is


def test_push_is_a_clear_501(server: Server) -> None:
    r = admin(server, "/api/push", {"model": "m1"})
    assert r.status_code == 501
    assert "push is not supported" in r.json()["error"]


# --- / and CORS ---------------------------------------------------------------------------------


def test_root_says_ollama_is_running_to_non_browsers(server: Server) -> None:
    r = httpx.get(server.url + "/", timeout=10)
    assert r.status_code == 200 and r.text == "Ollama is running"
    assert r.headers["content-type"].startswith("text/plain")
    assert httpx.head(server.url + "/", timeout=10).status_code == 200
    page = httpx.get(server.url + "/", headers={"Accept": "text/html,*/*"}, timeout=10)
    assert page.headers["content-type"].startswith("text/html")
    assert '<div id="app"' in page.text


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1:5173",
                                    "https://localhost", "app://obsidian.md",
                                    "vscode-webview://abc"])
def test_local_origins_are_allowed_by_default(server: Server, origin: str) -> None:
    pre = httpx.options(server.url + "/api/chat", timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == origin
    assert "access-control-allow-credentials" not in pre.headers
    r = httpx.post(server.url + "/api/show", json={"model": "m1"}, timeout=10,
                   headers={"Origin": origin})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == origin


@pytest.mark.parametrize("origin", ["https://evil.example", "http://localhost.evil.example",
                                    "http://127.0.0.1.nip.io:8080", "null"])
def test_other_origins_get_no_cors_headers(server: Server, origin: str) -> None:
    pre = httpx.options(server.url + "/api/chat", timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers
    r = httpx.get(server.url + "/api/tags", timeout=10, headers={"Origin": origin})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.post(server.url + "/api/show", json={"model": "m1"}, timeout=10,
                   headers={"Origin": origin})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_a_local_origin_may_not_reach_the_admin_routes(server: Server) -> None:
    r = httpx.post(server.url + "/admin/rescan", timeout=10,
                   headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 403, r.text


# --- the CLI ------------------------------------------------------------------------------------


def test_the_cli_falls_back_to_ollama_host(server: Server) -> None:
    env = {**os.environ, "MODELYARD_HOME": str(server.home), "COLUMNS": "250", "NO_COLOR": "1",
           "OLLAMA_HOST": f"127.0.0.1:{server.port}"}
    env.pop("MODELYARD_URL", None)
    done = subprocess.run([sys.executable, "-m", "modelyard", "ps"], capture_output=True,
                          text=True, timeout=50, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "engine" in done.stdout.lower()
    # MODELYARD_URL still wins over it.
    env["MODELYARD_URL"] = "http://127.0.0.1:9"  # discard port: nothing answers there
    done = subprocess.run([sys.executable, "-m", "modelyard", "ps"], capture_output=True,
                          text=True, timeout=50, env=env)
    assert done.returncode == 1 and "127.0.0.1:9" in done.stdout + done.stderr
