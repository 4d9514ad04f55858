"""Tokens per day and concurrent requests on a real `modelyard serve` over a real fake
llama-server: the day's tokens are what the backend reported, a request is refused once they
reach the quota; a token with `max_concurrent: 1` is refused while its stream runs and admitted
again once the stream is over."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from tests.integration.harness import HELLO, config, module_server
from tests.support import Server, fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = config(fake_model("m1", "--tokens-per-s", "20"), limits_refresh_s=0.2)
    with module_server(tmp_path_factory, cfg, "--single-process") as started:
        yield started


def user_token(server: Server, name: str) -> tuple[str, dict[str, str]]:
    admin = server.admin_headers
    r = httpx.post(server.url + "/admin/users", headers=admin, timeout=10,
                   json={"name": name, "password": "a-long-password"})
    assert r.status_code == 201, r.text
    r = httpx.post(server.url + "/tokens", headers=admin, timeout=10,
                   json={"name": "t", "owner": name})
    assert r.status_code == 201, r.text
    return r.json()["id"], {"Authorization": f"Bearer {r.json()['token']}"}


def set_limit(server: Server, subject: str, **values: int) -> None:
    r = httpx.put(f"{server.url}/admin/limits/{subject}", json=values,
                  headers=server.admin_headers, timeout=10)
    assert r.status_code == 200, r.text


def usage(server: Server, subject: str) -> dict[str, int]:
    r = httpx.get(server.url + "/admin/limits", headers=server.admin_headers, timeout=10)
    return {row["subject"]: row["usage"] for row in r.json()["limits"]}[subject]


def chat(server: Server, headers: dict[str, str], max_tokens: int) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=30,
                      json={"model": "m1", "messages": HELLO, "max_tokens": max_tokens})


def test_tokens_per_day_refuse_once_the_reported_tokens_reach_the_quota(server: Server) -> None:
    token_id, grace = user_token(server, "grace")
    set_limit(server, f"token:{token_id}", tokens_per_day=20)
    r = chat(server, grace, 8)
    assert r.status_code == 200, r.text
    spent = r.json()["usage"]["total_tokens"]
    assert 0 < spent < 20
    assert r.headers["X-RateLimit-Remaining"] == "20"  # counted when a request ends
    # Its tokens reach the shared counter (a background flush): exactly what was reported.
    poll(lambda: usage(server, f"token:{token_id}")["tokens_today"] == spent,
         what="the day's tokens counted")
    r = chat(server, grace, 16)  # under the quota when it starts: it runs and crosses it
    assert r.status_code == 200, r.text
    total = spent + r.json()["usage"]["total_tokens"]
    assert total >= 20
    poll(lambda: usage(server, f"token:{token_id}")["tokens_today"] == total,
         what="the second request's tokens counted")
    r = chat(server, grace, 1)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "rate_limited"
    assert int(r.headers["Retry-After"]) > 0 and r.headers["X-RateLimit-Limit"] == "20"


async def test_max_concurrent_refuses_while_a_stream_runs(server: Server) -> None:
    token_id, heidi = user_token(server, "heidi")
    set_limit(server, f"token:{token_id}", max_concurrent=1)
    body = {"model": "m1", "messages": HELLO, "max_tokens": 200, "stream": True}
    async with (httpx.AsyncClient(base_url=server.url, headers=heidi, timeout=30) as http,
                http.stream("POST", "/v1/chat/completions", json=body) as stream):
        assert stream.status_code == 200
        lines = stream.aiter_lines()
        assert (await anext(lines)).startswith("data:")  # it is running
        r = await http.post("/v1/chat/completions", json={**body, "stream": False})
        assert r.status_code == 429, r.text
        assert "requests running" in r.json()["error"]["message"]
        assert usage(server, f"token:{token_id}")["concurrent"] == 1
    # The client left: the slot is given back when the front notices.
    poll(lambda: usage(server, f"token:{token_id}")["concurrent"] == 0,
         what="the stream's slot released")
    r = chat(server, heidi, 2)
    assert r.status_code == 200, r.text
