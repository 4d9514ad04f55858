"""What must hold across the workers of `serve --workers 2` (issue 33 item 4), on SQLite: the
login throttle (two workers must not mean twice the guesses) and a model's `max_queue` (the
engine's queue is the one queue of every worker)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from tests.integration.harness import HELLO, config
from tests.integration.test_workers_process import HEADER, from_each_worker
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ADMIN_PASSWORD = "workers-admin-pw-1"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("workers")
    slow = fake_model("slow", "--tokens-per-s", "10", max_concurrency=1, max_queue=1)
    old = os.environ.get("MODELYARD_ADMIN_PASSWORD")
    os.environ["MODELYARD_ADMIN_PASSWORD"] = ADMIN_PASSWORD
    server = Server(home, config(slow), "--workers", "2")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()
        if old is None:
            os.environ.pop("MODELYARD_ADMIN_PASSWORD", None)
        else:
            os.environ["MODELYARD_ADMIN_PASSWORD"] = old


def test_failed_logins_through_both_workers_are_counted_together(server: Server) -> None:
    r = httpx.post(server.url + "/admin/users", headers=server.admin_headers, timeout=30,
                   json={"name": "tess", "password": "tess-pw-123",
                         "must_change_password": False})
    assert r.status_code == 201, r.text
    # The user's five free failures, each on a connection of its own: the kernel spreads them
    # over the workers; one process's count alone would not reach five.
    codes = []
    for i in range(5):
        with httpx.Client(timeout=30) as client:
            codes.append(client.post(server.url + "/auth/login", json={
                "username": "tess", "password": f"guess-{i}"}).status_code)
    assert codes == [401] * 5
    # Now blocked on every worker, even with the right password.
    answers = from_each_worker(lambda c: c.post(server.url + "/auth/login", json={
        "username": "tess", "password": "tess-pw-123"}))
    for worker, answer in answers.items():
        assert answer.status_code == 429, (worker, answer.text)
        assert answer.json()["error"] == "too_many_attempts"


def test_max_queue_holds_across_both_workers(server: Server) -> None:
    """max_concurrency 1, max_queue 1: of twelve requests at once, wherever they land, one
    runs, one waits, and ten are refused 429 queue_full, by both workers."""
    warm = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "slow", "messages": HELLO, "max_tokens": 1})
    assert warm.status_code == 200, warm.text

    def one(_: int) -> tuple[int, str, str]:
        with httpx.Client(timeout=60) as client:
            r = client.post(server.url + "/v1/chat/completions", json={
                "model": "slow", "messages": HELLO, "max_tokens": 20})
        code = r.json().get("error", {}).get("code", "") if r.status_code != 200 else ""
        return r.status_code, code, r.headers[HEADER]

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(one, range(12)))
    served = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] == 429]
    assert len(served) == 2 and len(refused) == 10, answers
    assert {a[1] for a in refused} == {"queue_full"}, answers
    assert {a[2] for a in answers} == {"0/2", "1/2"}, "both workers took requests"
