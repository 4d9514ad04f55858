"""Issue 31 §6, §7 and §9 through a real `modelyard serve` on loopback (auth `auto`): what a local
caller can no longer pretend (its address, being nobody with a dead token) and what an anonymous
or inference caller can no longer read (other users' names, the model files' paths).

One server is shared by the module. Only the throttle tests log in (they block 127.0.0.1's
logins for a while): the others use tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from tests.integration.harness import HELLO, config, module_server
from tests.support import Server, fake_model, poll, tiny_gguf

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PROXY = "127.0.0.2"  # the reverse proxy this server is told to believe (forwarded_allow_ips)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gguf(tmp_path_factory.mktemp("secret-dir") / "local-model.gguf")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, gguf: Path) -> Iterator[Server]:
    cfg = config(fake_model("m1"), fake_model("slow", "--load-time-s", "6", max_concurrency=4),
                 {"id": "local", "backend": "llamacpp", "path": str(gguf)},
                 forwarded_allow_ips=[PROXY])
    with module_server(tmp_path_factory, cfg, "--single-process") as srv:
        yield srv


def minted(server: Server, user: str) -> tuple[dict[str, str], str]:
    """An inference token of `user` (made with the admin's CLI token; the user is created
    first): its headers and its id."""
    httpx.post(server.url + "/admin/users", headers=server.admin_headers, timeout=30,
               json={"name": user, "password": f"{user}-pw-1234", "must_change_password": False})
    r = httpx.post(server.url + "/tokens", headers=server.admin_headers, timeout=30,
                   json={"name": f"{user}s", "owner": user, "scopes": ["inference"]})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}, r.json()["id"]


def token_of(server: Server, user: str) -> dict[str, str]:
    return minted(server, user)[0]


def chat(server: Server, headers: dict[str, str], model: str = "m1") -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=30,
                      json={"model": model, "messages": HELLO, "max_tokens": 2})


def failed_logins(client: httpx.Client, server: Server, count: int) -> list[int]:
    """`count` wrong passwords, each for another name and from another X-Forwarded-For."""
    return [client.post(server.url + "/auth/login", headers={"X-Forwarded-For": f"203.0.113.{i}"},
                        json={"username": f"nobody{i}", "password": "wrong-pw"}).status_code
            for i in range(count)]


# ---- §6: the address the login throttle counts ------------------------------------------------


def test_a_local_client_cannot_choose_its_address_with_x_forwarded_for(server: Server) -> None:
    """uvicorn believed X-Forwarded-For from 127.0.0.1 by default: 25 failed logins, each
    from a made-up address, and the address throttle never saw two from one."""
    with httpx.Client(timeout=30) as client:
        codes = failed_logins(client, server, 25)
    assert codes[:20] == [401] * 20, codes
    assert codes[20:] == [429] * 5, codes


def test_a_configured_proxy_is_believed(server: Server) -> None:
    """From a peer in forwarded_allow_ips, X-Forwarded-For is the client: each made-up address
    is a client of its own, and none is blocked (nor is the proxy)."""
    proxy = httpx.HTTPTransport(local_address=PROXY)
    with httpx.Client(timeout=30, transport=proxy) as client:
        assert failed_logins(client, server, 25) == [401] * 25


# ---- §9: a token that is not valid, scoped tokens, account routes -------------------------------


def test_a_token_that_is_not_valid_is_a_401_even_on_open_routes(server: Server) -> None:
    """On an open loopback server a revoked or made-up token made its caller anonymous, out of
    the limits of the token's user."""
    gina, gina_id = minted(server, "gina")
    assert chat(server, gina).status_code == 200
    r = httpx.delete(server.url + f"/tokens/{gina_id}", headers=server.admin_headers, timeout=30)
    assert r.status_code == 200, r.text
    for dead in (gina, {"Authorization": "Bearer my-made-up"}, {"x-api-key": "my-made-up"}):
        r = chat(server, dead)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", r.text
        r = httpx.get(server.url + "/api/tags", headers=dead, timeout=30)
        assert r.status_code == 401, r.text
    # Keys that are no modelyard token name nobody: ignored, as Ollama does (SDKs need a key).
    assert chat(server, {"Authorization": "Bearer sk-anything"}).status_code == 200
    assert chat(server, {}).status_code == 200


def test_an_inference_token_cannot_change_its_accounts_settings(server: Server) -> None:
    hank = token_of(server, "hank")
    r = httpx.patch(server.url + "/auth/me", headers=hank, timeout=30,
                    json={"archive_retention": "1d"})
    assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
    me = httpx.get(server.url + "/auth/me", headers=hank, timeout=30)  # reading is fine
    assert me.status_code == 200 and me.json()["user"]["archive_retention"] is None, me.text


# ---- §7: other users' names and local paths -------------------------------------------------


def owners_in(metrics_text: str) -> set[str]:
    return {line.split('owner="', 1)[1].split('"', 1)[0]
            for line in metrics_text.splitlines()
            if line.startswith("modelyard_usage_requests_total{")}


def test_metrics_name_owners_to_admins_only(server: Server) -> None:
    bob = token_of(server, "bob")
    assert chat(server, bob).status_code == 200

    def scraped(headers: dict[str, str]) -> set[str]:
        r = httpx.get(server.url + "/metrics", headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        return owners_in(r.text)

    poll(lambda: "bob" in scraped(server.admin_headers), what="bob's usage in the metrics")
    for caller in ({}, token_of(server, "ivy")):  # an anonymous scraper, another user
        seen = scraped(caller)
        assert "bob" not in seen, seen
        assert seen - {"anonymous", "other"} and all(
            o.startswith("u-") for o in seen - {"anonymous", "other"}), seen
    assert scraped({}) == scraped({})  # stable from scrape to scrape


def test_status_shows_a_client_no_other_owner(server: Server) -> None:
    bob = token_of(server, "bob")

    def owners(headers: dict[str, str]) -> dict[str, object]:
        status = httpx.get(server.url + "/status", headers=headers, timeout=30).json()
        return dict(status["queues"].get("slow", {}).get("owners", {}))

    with ThreadPoolExecutor(1) as pool:  # bob's request holds its slot while `slow` loads
        answer = pool.submit(chat, server, bob, "slow")
        poll(lambda: "bob" in owners(server.admin_headers), what="bob's request in the queue")
        assert "bob" in owners(bob)  # one's own entry
        for caller in ({}, token_of(server, "ivy")):
            assert owners(caller) == {}, caller
            overview = httpx.get(server.url + "/v1/status", headers=caller, timeout=30).json()
            assert '"bob"' not in json.dumps(overview)
        assert answer.result().status_code == 200


def test_api_show_names_no_file_to_non_admins(server: Server, gguf: Path) -> None:
    for caller in ({}, token_of(server, "ivy")):
        r = httpx.post(server.url + "/api/show", headers=caller, json={"model": "local"},
                       timeout=30)
        assert r.status_code == 200, r.text
        assert str(gguf.parent) not in r.text, r.text
        assert r.json()["modelfile"].startswith("FROM local\n")
    r = httpx.post(server.url + "/api/show", headers=server.admin_headers,
                   json={"model": "local"}, timeout=30)
    assert r.json()["modelfile"].startswith(f"FROM {gguf}\n")  # the operator sees the file


# ---- §9: the Studio's headers ----------------------------------------------------------------


def test_studio_responses_carry_a_csp_and_refuse_framing(server: Server) -> None:
    pages = [("/", {"Accept": "text/html"}), ("/login", {}), ("/studio/assets/js/main.js", {}),
             ("/studio/assets/studio.css", {})]
    for path, headers in pages:
        r = httpx.get(server.url + path, headers=headers, timeout=30)
        assert r.status_code == 200, (path, r.text)
        csp = r.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp, csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp, csp
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["referrer-policy"] == "same-origin"
