"""Two fronts on one PostgreSQL database (issue 21 point 6): two real `modelyard serve`
processes, each with its own home and its own fake engine processes, sharing the database and a
`shared_dir`. They share users, logins (the cookie key), tokens and pull jobs (a job is run by
exactly one front; a front starting does not fail another's job); a chat session continues on the
other front; a config reload on one reaches the other."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tests.fakes.hub_repos import HubServer
from tests.integration.harness import HELLO, config
from tests.integration.pull_support import (
    get_job,
    hub_env,
    partials,
    quant_repo,
    start_server,
    submit,
    wait_bytes,
    wait_job,
)
from tests.support import Server, fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.postgres, pytest.mark.timeout(240)]

MB = 1_000_000
SYNC_S = 0.3  # front_sync_interval_s: claims renewed and reloads seen this often


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    root = tmp_path_factory.mktemp("hub") / "repos"
    # ~30 s at 0.5 MB/s: longer than a front's restart on a busy machine
    quant_repo(root, "org/shared-GGUF", 15 * MB, ("Q4_0",), seed=31)
    quant_repo(root, "org/stopped-GGUF", 15 * MB, ("Q4_0",), seed=32)
    with HubServer(root, log=root.parent / "hub.jsonl", bytes_per_s=MB // 2) as server:
        yield server


class Fronts:
    def __init__(self, base: Path, url: str, hub: HubServer) -> None:
        self.base, self.hub = base, hub
        self.cfg = config(fake_model("m"), database_url=url, shared_dir=str(base / "shared"),
                          front_sync_interval_s=SYNC_S, chat_session_persist=True,
                          auth="required")
        self.a = self.start("a")
        self.b = self.start("b")

    def start(self, name: str) -> Server:
        return start_server(self.base / name, self.cfg,
                            hub_env(self.hub, self.base / f"hf-{name}"))

    def restart_b(self) -> None:
        self.b.stop()
        self.b = self.start("b")


@pytest.fixture(scope="module")
def fronts(tmp_path_factory: pytest.TempPathFactory, postgres_url: str,
           hub: HubServer) -> Iterator[Fronts]:
    two = Fronts(tmp_path_factory.mktemp("fronts"), postgres_url, hub)
    try:
        yield two
    finally:
        two.a.stop()
        two.b.stop()


def _chat(server: Server, session: str | None = None, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"model": "m", "messages": HELLO, "max_tokens": 3, **extra}
    headers = dict(server.admin_headers)
    if session is not None:
        headers["X-Session-Id"] = session
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=60)


def test_a_user_made_on_one_front_logs_in_on_the_other_and_its_cookie_works_on_both(
    fronts: Fronts,
) -> None:
    a, b = fronts.a, fronts.b
    made = httpx.post(a.url + "/admin/users", headers=a.admin_headers, json={
        "name": "ann", "password": "a long password", "must_change_password": False})
    assert made.status_code == 201, made.text
    with httpx.Client(base_url=b.url) as on_b:
        login = on_b.post("/auth/login", json={"username": "ann",
                                               "password": "a long password"})
        assert login.status_code == 200, login.text
        cookies = dict(on_b.cookies)
    assert cookies
    for server in (a, b):  # signed by B, valid on A: one key in shared_dir
        me = httpx.get(server.url + "/auth/me", cookies=cookies)
        assert me.status_code == 200, me.text
        assert me.json()["user"]["name"] == "ann"
    assert (fronts.base / "shared" / "secret-key").is_file()
    assert not (fronts.base / "a" / "secret-key").exists()


def test_a_token_made_on_one_front_works_on_the_other(fronts: Fronts) -> None:
    a, b = fronts.a, fronts.b
    made = httpx.post(a.url + "/tokens", headers=a.admin_headers,
                      json={"name": "shared", "scopes": ["inference"]})
    assert made.status_code == 201, made.text
    secret = made.json()["token"]
    bearer = {"Authorization": f"Bearer {secret}"}
    assert httpx.get(b.url + "/v1/models", headers=bearer).status_code == 200
    assert httpx.get(b.url + "/v1/models",
                     headers={"Authorization": "Bearer nope"}).status_code == 401
    # Each front's CLI token is its own: B starting did not revoke A's.
    for server in (a, b):
        assert httpx.get(server.url + "/v1/models",
                         headers=server.admin_headers).status_code == 200


def test_a_session_made_on_one_front_continues_on_the_other(fronts: Fronts) -> None:
    a, b = fronts.a, fronts.b
    first = _chat(a, "travel-plans")
    assert first.status_code == 200, first.text

    def turns_on(server: Server) -> int:
        r = httpx.get(server.url + "/v1/sessions/travel-plans", headers=server.admin_headers)
        return int(r.json()["turns"]) if r.status_code == 200 else 0

    poll(lambda: turns_on(b) == 1, what="A's turn in the database, seen on B")
    second = _chat(b, "travel-plans")
    assert second.status_code == 200, second.text
    poll(lambda: turns_on(a) == 2, what="B's turn seen on A")
    history = httpx.get(a.url + "/v1/sessions/travel-plans", headers=a.admin_headers).json()
    # both turns' user messages and answers, in order: B continued A's conversation
    assert [m["role"] for m in history["messages"]] == ["user", "assistant"] * 2


def test_a_pull_job_is_run_by_one_front_and_another_starting_does_not_fail_it(
    fronts: Fronts,
) -> None:
    a = fronts.a
    job = submit(a, "org/shared-GGUF:Q4_0")["job"]
    poll(lambda: get_job(a, job["id"])["status"] == "running", what="running on A")
    seen_on_b = get_job(fronts.b, job["id"])  # one database: B sees A's job
    assert seen_on_b["status"] == "running"
    fronts.restart_b()  # B starting recovers interrupted jobs: not A's live one
    assert get_job(fronts.b, job["id"])["status"] == "running"
    assert get_job(a, job["id"])["status"] == "running"
    done = wait_job(a, job["id"], timeout_s=120)
    assert done["status"] == "succeeded", done
    assert get_job(fronts.b, job["id"])["status"] == "succeeded"
    # exactly one front ran it: only A has its pull log
    assert (fronts.base / "a" / "logs" / "pulls" / f"{job['id']}.log").is_file()
    assert not (fronts.base / "b" / "logs" / "pulls" / f"{job['id']}.log").exists()


def test_a_job_cancelled_on_another_front_stops_where_it_runs(fronts: Fronts) -> None:
    a, b = fronts.a, fronts.b
    job = submit(a, "org/stopped-GGUF:Q4_0")["job"]
    wait_bytes(a, job["id"], 1)
    assert partials(fronts.base / "hf-a")  # A downloads it
    r = httpx.delete(f"{b.url}/jobs/{job['id']}", headers=b.admin_headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "cancelled"
    # A stops its pull at its next heartbeat: the child removes its partial file
    poll(lambda: not partials(fronts.base / "hf-a"), timeout_s=10, what="A's pull stopped")
    assert get_job(a, job["id"])["status"] == "cancelled"


def test_a_reload_on_one_front_reaches_the_other(fronts: Fronts) -> None:
    a, b = fronts.a, fronts.b

    def listed(server: Server) -> set[str]:
        r = httpx.get(server.url + "/v1/models", headers=server.admin_headers)
        return {m["id"] for m in r.json()["data"]}

    assert "later" not in listed(b)
    # Both fronts' config files gain a model (one shared file, in effect); only A is told.
    for server in (a, b):
        cfg = yaml.safe_load(server.config_file.read_text())
        cfg["models"].append(fake_model("later"))
        server.config_file.write_text(yaml.safe_dump(cfg))
    r = httpx.post(a.url + "/admin/reload", headers=a.admin_headers, timeout=60)
    assert r.status_code == 200, r.text
    assert "later" in listed(a)
    poll(lambda: "later" in listed(b), timeout_s=30, what="B reloaded after A")
