"""Issue 15 (§2, §11, §12) through a real `modelyard serve`: what a leaked inference token, a
password guesser, a web page in the browser and an anonymous local caller can no longer do.

One server is shared by the module; tests use their own users, so the per-user login throttle
one of them trips does not touch the others.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from tests.integration.harness import HELLO, config
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ADMIN_PASSWORD = "hardening-admin-pw"
APP_ORIGIN = "http://app.example"  # configured in cors_origins


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("hardening")
    gguf = home / "local-model.gguf"  # a model with a local path (never loaded)
    gguf.write_bytes(b"GGUF")
    cfg = config(fake_model("m1"), {"id": "local", "backend": "llamacpp", "path": str(gguf)},
                 cors_origins=[APP_ORIGIN])
    old = os.environ.get("MODELYARD_ADMIN_PASSWORD")
    os.environ["MODELYARD_ADMIN_PASSWORD"] = ADMIN_PASSWORD
    try:
        srv = Server(home, cfg, "--single-process")
    finally:
        if old is None:
            os.environ.pop("MODELYARD_ADMIN_PASSWORD", None)
        else:
            os.environ["MODELYARD_ADMIN_PASSWORD"] = old
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def admin(server: Server) -> dict[str, str]:
    """The CLI's admin token, read afresh (a password change of admin replaces it)."""
    return server.admin_headers


def add_user(server: Server, name: str, password: str) -> None:
    r = httpx.post(server.url + "/admin/users", headers=admin(server), timeout=30,
                   json={"name": name, "password": password, "must_change_password": False})
    assert r.status_code == 201, r.text


def login(server: Server, name: str, password: str, **headers: str) -> httpx.Client:
    client = httpx.Client(base_url=server.url, timeout=30)
    r = client.post("/auth/login", json={"username": name, "password": password},
                    headers=headers)
    assert r.status_code == 200, r.text
    client.headers["X-CSRF-Token"] = r.json()["csrf_token"]
    return client


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def mint(server: Server, headers: dict[str, str], **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/tokens", headers=headers, json=body, timeout=30)


def error_code(r: httpx.Response) -> str:
    error = r.json()["error"]
    return str(error["code"] if isinstance(error, dict) else error)


def me(server: Server, headers: dict[str, str]) -> int:
    return httpx.get(server.url + "/auth/me", headers=headers, timeout=30).status_code


# ---- §2: a token does only what its scope allows ------------------------------------------------


def test_an_inference_token_cannot_mint_revoke_or_change_the_password(server: Server) -> None:
    secret = mint(server, admin(server), name="leaked", scopes=["inference"],
                  expires_in_s=60).json()["token"]
    leaked = bearer(secret)
    cli_id = next(t["id"] for t in httpx.get(server.url + "/tokens", headers=admin(server),
                                             timeout=30).json()["tokens"] if t["name"] == "cli")
    r = mint(server, leaked, name="forever", scopes=["inference"])
    assert r.status_code == 403 and error_code(r) == "forbidden", r.text
    r = httpx.delete(server.url + f"/tokens/{cli_id}", headers=leaked, timeout=30)
    assert r.status_code == 403, r.text
    r = httpx.post(server.url + "/auth/password", headers=leaked, timeout=30,
                   json={"current_password": ADMIN_PASSWORD, "new_password": "taken-over-pw"})
    assert r.status_code == 403, r.text
    assert httpx.get(server.url + "/tokens", headers=leaked, timeout=30).status_code == 403
    # What it is for still works; the admin's CLI token and password are untouched.
    r = httpx.post(server.url + "/v1/chat/completions", headers=leaked, timeout=30,
                   json={"model": "m1", "messages": HELLO, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert me(server, admin(server)) == 200
    login(server, "admin", ADMIN_PASSWORD).close()


def test_a_token_minted_with_a_token_never_outlives_nor_outranks_it(server: Server) -> None:
    parent = mint(server, admin(server), name="parent", scopes=["inference", "admin"],
                  expires_in_s=60).json()
    r = mint(server, bearer(parent["token"]), name="child", scopes=["inference"])
    assert r.status_code == 201, r.text
    child = r.json()
    assert child["parent_id"] == parent["id"]
    assert child["expires_at"] is not None and child["expires_at"] <= parent["expires_at"]
    longer = mint(server, bearer(parent["token"]), name="longer", scopes=["inference"],
                  expires_in_s=10 * 365 * 86400).json()
    assert longer["expires_at"] <= parent["expires_at"]
    # The child has no admin scope, so it mints nothing (let alone an admin token).
    assert mint(server, bearer(child["token"]), name="grandchild",
                scopes=["inference"]).status_code == 403
    assert me(server, bearer(child["token"])) == 200
    r = httpx.delete(server.url + f"/tokens/{parent['id']}", headers=admin(server), timeout=30)
    assert r.status_code == 200, r.text
    assert me(server, bearer(parent["token"])) == 401
    assert me(server, bearer(child["token"])) == 401
    assert me(server, bearer(longer["token"])) == 401


def test_a_password_reset_revokes_the_users_tokens_and_sessions(server: Server) -> None:
    add_user(server, "ruth", "ruth-pw-123")
    ruth = login(server, "ruth", "ruth-pw-123")
    r = ruth.post("/tokens", json={"name": "ruths", "scopes": ["inference"]})
    assert r.status_code == 201, r.text
    token = bearer(r.json()["token"])
    assert me(server, token) == 200
    r = httpx.post(server.url + "/admin/users/ruth/password", headers=admin(server),
                   json={"password": "reset-pw-456"}, timeout=30)
    assert r.status_code == 200, r.text
    assert me(server, token) == 401
    assert ruth.get("/auth/me").status_code == 401
    # Her own change (after the forced one) revokes the tokens she made in between.
    ruth = login(server, "ruth", "reset-pw-456")
    r = ruth.post("/auth/password", json={"current_password": "reset-pw-456",
                                          "new_password": "ruths-own-pw"})
    assert r.status_code == 200, r.text
    ruth.headers["X-CSRF-Token"] = r.json()["csrf_token"]
    token = bearer(ruth.post("/tokens", json={"name": "again"}).json()["token"])
    r = ruth.post("/auth/password", json={"current_password": "ruths-own-pw",
                                          "new_password": "ruths-newer-pw"})
    assert r.status_code == 200, r.text
    assert me(server, token) == 401


def test_an_admin_changing_their_password_keeps_the_cli_working(server: Server) -> None:
    """The CLI token is the admin's: it is revoked with the old password and a new one is
    written to $MODELYARD_HOME/cli-token, so `modelyard …` commands keep working."""
    old_cli = admin(server)
    client = login(server, "admin", ADMIN_PASSWORD)
    r = client.post("/auth/password", json={"current_password": ADMIN_PASSWORD,
                                            "new_password": ADMIN_PASSWORD + "-2"})
    assert r.status_code == 200, r.text
    assert me(server, old_cli) == 401
    assert admin(server) != old_cli
    assert httpx.get(server.url + "/admin/engines", headers=admin(server),
                     timeout=30).status_code == 200
    client.headers["X-CSRF-Token"] = r.json()["csrf_token"]
    r = client.post("/auth/password", json={"current_password": ADMIN_PASSWORD + "-2",
                                            "new_password": ADMIN_PASSWORD})
    assert r.status_code == 200, r.text


# ---- §11: logins ---------------------------------------------------------------------------------


def test_failed_logins_are_throttled_with_retry_after(server: Server) -> None:
    add_user(server, "tess", "tess-pw-123")
    codes = [httpx.post(server.url + "/auth/login", timeout=30,
                        json={"username": "tess", "password": f"guess-{i}"}).status_code
             for i in range(5)]
    assert codes == [401] * 5
    r = httpx.post(server.url + "/auth/login", timeout=30,
                   json={"username": "tess", "password": "tess-pw-123"})  # right, but blocked
    assert r.status_code == 429 and r.json()["error"] == "too_many_attempts", r.text
    retry_after_s = int(r.headers["retry-after"])
    assert 0 < retry_after_s <= 30
    # Others are not locked out by tess's guesser.
    login(server, "admin", ADMIN_PASSWORD).close()


def test_a_blank_password_is_refused(server: Server) -> None:
    r = httpx.post(server.url + "/admin/users", headers=admin(server), timeout=30,
                   json={"name": "blank", "password": " " * 8})
    assert r.status_code == 400 and r.json()["param"] == "password", r.text
    add_user(server, "uma", "uma-pw-1234")
    uma = login(server, "uma", "uma-pw-1234")
    for bad in (" " * 8, " " * 40, "x" * 1025):
        r = uma.post("/auth/password", json={"current_password": "uma-pw-1234",
                                             "new_password": bad})
        assert r.status_code == 400 and r.json()["param"] in ("password", "new_password"), r.text


def test_login_refuses_text_plain_and_foreign_origins(server: Server) -> None:
    add_user(server, "vic", "vic-pw-1234")
    body = orjson.dumps({"username": "vic", "password": "vic-pw-1234"})
    url = server.url + "/auth/login"
    # A page elsewhere can post a form or text/plain without a preflight: refused.
    r = httpx.post(url, content=body, headers={"Content-Type": "text/plain"}, timeout=30)
    assert r.status_code == 415 and r.json()["error"] == "unsupported_media_type", r.text
    r = httpx.post(url, content=body, timeout=30,
                   headers={"Content-Type": "application/json", "Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"] == "origin_not_allowed", r.text
    r = httpx.post(url, content=body, timeout=30,
                   headers={"Content-Type": "application/json", "Origin": "null"})
    assert r.status_code == 403, r.text
    # The server's own pages, and origins configured for CORS, may.
    login(server, "vic", "vic-pw-1234", Origin=server.url).close()
    login(server, "vic", "vic-pw-1234", Origin=APP_ORIGIN).close()


def test_cookie_requests_refuse_foreign_origins_and_non_json(server: Server) -> None:
    add_user(server, "walt", "walt-pw-1234")
    walt = login(server, "walt", "walt-pw-1234")
    r = walt.post("/tokens", json={"name": "x"}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"] == "origin_not_allowed", r.text
    r = walt.post("/tokens", content=b'{"name": "x"}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 415, r.text
    r = walt.post("/v1/chat/completions", headers={"Content-Type": "text/plain"},
                  content=orjson.dumps({"model": "m1", "messages": HELLO, "max_tokens": 2}))
    assert r.status_code == 415, r.text
    assert walt.post("/tokens", json={"name": "ok"}, headers={"Origin": server.url}
                     ).status_code == 201
    assert walt.post("/auth/logout", headers={"Origin": server.url}).status_code == 200


def test_the_studio_may_upload_a_batch_file_as_multipart_with_its_csrf_header(
        server: Server) -> None:
    add_user(server, "yara", "yara-pw-1234")
    yara = login(server, "yara", "yara-pw-1234")
    line = orjson.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m1", "messages": HELLO}}) + b"\n"
    form: dict[str, Any] = {"files": {"file": ("in.jsonl", line)}, "data": {"purpose": "batch"}}
    r = yara.post("/v1/files", headers={"Origin": server.url}, **form)
    assert r.status_code == 200 and r.json()["purpose"] == "batch", r.text
    # The CSRF header is what a cross-site form cannot send: without it, refused.
    r = yara.post("/v1/files", headers={"X-CSRF-Token": ""}, **form)
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed", r.text
    r = yara.post("/v1/files", headers={"Origin": "http://evil.example"}, **form)
    assert r.status_code == 403, r.text
    # Only that upload: multipart elsewhere, and text/plain there, stay refused.
    r = yara.post("/v1/chat/completions", **form)
    assert r.status_code == 415, r.text
    r = yara.post("/v1/files", content=line, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415, r.text


def test_origin_rules_spare_bearer_clients_and_guard_open_routes(server: Server) -> None:
    chat = {"model": "m1", "messages": HELLO, "max_tokens": 2}
    url = server.url + "/v1/chat/completions"
    # An anonymous (loopback, auth auto) request a page elsewhere could make: refused.
    r = httpx.post(url, json=chat, headers={"Origin": "http://evil.example"}, timeout=30)
    assert r.status_code == 403 and error_code(r) == "origin_not_allowed", r.text
    # Non-browser clients (no Origin), bearer clients, and the configured origin are served.
    assert httpx.post(url, json=chat, timeout=30).status_code == 200
    assert httpx.post(url, content=orjson.dumps(chat), timeout=30,  # curl -d sends a form type
                      headers={"Content-Type": "application/x-www-form-urlencoded"}
                      ).status_code == 200
    assert httpx.post(url, json=chat, timeout=30, headers={
        **admin(server), "Origin": "http://evil.example"}).status_code == 200
    assert httpx.post(url, json=chat, headers={"Origin": APP_ORIGIN}, timeout=30
                      ).status_code == 200


# ---- §12: what anonymous and inference callers see --------------------------------------------


def leaks(payload: Any, home: Path) -> list[str]:
    """Fields and values a client has no business with, found anywhere in `payload`."""
    found: list[str] = []

    def walk(value: Any, where: str) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                if key in ("pid", "upstream", "url", "argv", "local_path", "mmproj", "home",
                           "llama_server", "last_error"):
                    found.append(f"{where}.{key}")
                walk(inner, f"{where}.{key}")
        elif isinstance(value, list):
            for i, inner in enumerate(value):
                walk(inner, f"{where}[{i}]")
        elif isinstance(value, str) and (str(home) in value or "127.0.0.1:" in value):
            found.append(f"{where}={value}")

    walk(payload, "")
    return found


def test_anonymous_and_inference_callers_see_no_pids_urls_or_paths(server: Server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": "m1", "messages": HELLO, "max_tokens": 2})
    assert r.status_code == 200, r.text  # m1 is loaded: it has a pid and an upstream URL
    inference = bearer(mint(server, admin(server), name="client",
                            scopes=["inference"]).json()["token"])
    for headers in ({}, inference):
        for path in ("/status", "/v1/status", "/models", "/diag"):
            r = httpx.get(server.url + path, headers=headers, timeout=30)
            assert r.status_code == 200, (path, r.text)
            assert leaks(r.json(), server.home) == [], (path, headers)
        status = httpx.get(server.url + "/status", headers=headers, timeout=30).json()
        (m1,) = [m for m in status["engines"][0]["models"] if m["model"] == "m1"]
        assert m1["state"] == "ready" and status["queues"]["m1"]["running"] == 0
        models = httpx.get(server.url + "/models", headers=headers, timeout=30).json()["models"]
        assert {"m1", "local"} <= {m["model"] for m in models}
        overview = httpx.get(server.url + "/v1/status", headers=headers, timeout=30).json()
        assert overview["pulls"] == [] and overview["summary"]["models_loaded"] >= 1


def test_the_admin_still_sees_everything(server: Server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": "m1", "messages": HELLO, "max_tokens": 2})
    assert r.status_code == 200, r.text
    status = httpx.get(server.url + "/status", headers=admin(server), timeout=30).json()
    (m1,) = [m for m in status["engines"][0]["models"] if m["model"] == "m1"]
    assert isinstance(m1["pid"], int) and m1["upstream"].startswith("http://127.0.0.1:")
    overview = httpx.get(server.url + "/v1/status", headers=admin(server), timeout=30).json()
    assert any(m.get("pid") for e in overview["engines"] for m in e["models"])
    models = httpx.get(server.url + "/models", headers=admin(server), timeout=30).json()
    (local,) = [m for m in models["models"] if m["model"] == "local"]
    assert local["local_path"] == str(server.home / "local-model.gguf")
    diag = httpx.get(server.url + "/diag", headers=admin(server), timeout=30).json()
    assert diag["home"] == str(server.home)


def test_the_studio_feed_of_a_non_admin_user_is_the_client_view(server: Server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": "m1", "messages": HELLO, "max_tokens": 2})
    assert r.status_code == 200, r.text
    add_user(server, "xena", "xena-pw-1234")
    xena = login(server, "xena", "xena-pw-1234")
    with xena.stream("GET", "/studio/events") as feed:
        data = next(line[5:] for line in feed.iter_lines() if line.startswith("data:"))
    event = orjson.loads(data)
    assert leaks(event, server.home) == [] and event["jobs"] == []
    assert any(m["model"] == "m1" for e in event["status"]["engines"] for m in e["models"])
