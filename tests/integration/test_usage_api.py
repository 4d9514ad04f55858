"""Usage accounting through a real `modelyard serve` over the fake llama-server process: the rows
of GET /v1/usage match the tokens the backend reported (prompt, cached, completion) for a
non-streamed and a streamed request of two users with their tokens; a user sees only their own;
bad filters are 400s; CSV; the bounded owner label in /metrics; and a restart keeps the counts
(the last flush at a clean stop)."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tests.e2e.compat.table import covers
from tests.integration.harness import HELLO, config, module_server
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# Flushed only at stop: every answer below must include what is still in memory.
CFG = config(fake_model("m", "--parallel", "1"), auth="required",
             usage_flush_interval_s=3600, usage_metric_top_owners=1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with module_server(tmp_path_factory, CFG, "--single-process") as server:
        yield server


@pytest.fixture(scope="module")
def bearer(server: Server) -> dict[str, dict[str, str]]:
    admin = httpx.Client(base_url=server.url, headers=server.admin_headers, timeout=30)
    found = {}
    with admin:
        for name in ("carol", "dave"):
            r = admin.post("/admin/users", json={"name": name, "password": f"{name}-pw-123",
                                                  "must_change_password": False})
            assert r.status_code in (200, 201), r.text
            r = admin.post("/tokens", json={"name": f"{name}-t", "owner": name})
            assert r.status_code in (200, 201), r.text
            found[name] = {"Authorization": f"Bearer {r.json()['token']}"}
            found[name + "-id"] = {"id": r.json()["id"]}
    return found


@pytest.fixture(scope="module")
def reported(server: Server, bearer: dict[str, dict[str, str]]) -> dict[str, dict[str, int]]:
    """carol: one JSON answer (usage in the body); dave: one stream without include_usage,
    after carol's on the same slot (so llama-server's timings count part of it as cached)."""
    body = {"model": "m", "messages": HELLO, "max_tokens": 5}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=bearer["carol"],
                   timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    carol = {"prompt": usage["prompt_tokens"], "completion": usage["completion_tokens"],
             "cached": usage["prompt_tokens_details"]["cached_tokens"]}
    timings: dict[str, Any] = {}
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={**body, "stream": True, "max_tokens": 7},
                      headers=bearer["dave"]) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert chunk.get("usage") is None  # only timings: the case the fix is about
                timings = chunk.get("timings") or timings
    dave = {"prompt": timings["prompt_n"] + timings["cache_n"],
            "completion": timings["predicted_n"], "cached": timings["cache_n"]}
    assert dave["cached"] > 0 and dave["prompt"] == carol["prompt"]  # same messages
    return {"carol": carol, "dave": dave}


def usage(server: Server, headers: dict[str, str], **params: str) -> httpx.Response:
    return httpx.get(server.url + "/v1/usage", params=params, headers=headers, timeout=30)


def test_rows_match_what_the_backend_reported(server: Server, bearer: Any,
                                              reported: dict[str, dict[str, int]]) -> None:
    r = usage(server, server.admin_headers)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["group_by"] == ["user", "model"]
    rows = {row["owner"]: row for row in body["data"]}
    assert set(rows) == {"carol", "dave"}  # admins see every owner
    for name, tokens in reported.items():
        row = rows[name]
        assert row["model"] == "m" and row["requests"] == 1 and row["errors"] == 0
        assert (row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"]) == \
            (tokens["prompt"], tokens["cached"], tokens["completion"]), name
        assert row["total_tokens"] == tokens["prompt"] + tokens["completion"]
        assert row["avg_duration_s"] > 0
    # A TTFT is measured for the stream (the JSON answer has none: it comes in one piece).
    assert 0 < rows["dave"]["avg_ttft_s"] <= rows["dave"]["avg_duration_s"]
    # By token: each user's request is under their token's id.
    r = usage(server, server.admin_headers, group_by="user,token,api")
    assert {(x["owner"], x["token_id"], x["api"]) for x in r.json()["data"]} == {
        ("carol", bearer["carol-id"]["id"], "openai"), ("dave", bearer["dave-id"]["id"], "openai")}


def test_a_user_sees_only_their_own(server: Server, bearer: Any, reported: Any) -> None:
    r = usage(server, bearer["dave"], group_by="user")
    assert r.status_code == 200, r.text
    assert [(x["owner"], x["requests"]) for x in r.json()["data"]] == [("dave", 1)]
    r = usage(server, bearer["dave"], owner="carol")
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert usage(server, bearer["dave"], owner="dave").status_code == 200
    r = usage(server, server.admin_headers, owner="carol", group_by="user")
    assert [x["owner"] for x in r.json()["data"]] == ["carol"]


@pytest.mark.parametrize(("params", "param"), [
    ({"group_by": "user,week"}, "group_by"),
    ({"start": "last tuesday"}, "start"),
    ({"end": "nan"}, "end"),
    ({"start": "2030-01-02", "end": "2030-01-01"}, "start"),
    ({"format": "xml"}, "format"),
    ({"model": "a\x00b"}, "model"),
])
def test_bad_filters_are_400(server: Server, bearer: Any, params: dict[str, str],
                             param: str) -> None:
    r = usage(server, bearer["carol"], **params)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request"
    assert r.json()["error"]["param"] == param


def test_filters_and_periods(server: Server, reported: Any) -> None:
    assert usage(server, server.admin_headers, model="other").json()["data"] == []
    r = usage(server, server.admin_headers, start="2020-01-01", end="2020-01-02")
    assert r.json()["data"] == [] and r.json()["start"] == "2020-01-01T00:00:00Z"
    r = usage(server, server.admin_headers, group_by="day,model")
    [row] = r.json()["data"]
    assert row["period"].endswith("T00:00:00Z") and row["requests"] == 2


def test_csv(server: Server, bearer: Any, reported: dict[str, dict[str, int]]) -> None:
    r = usage(server, server.admin_headers, format="csv")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    assert r.headers["content-disposition"].startswith('attachment; filename="modelyard-usage-')
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert {x["owner"]: int(x["prompt_tokens"]) for x in rows} == \
        {k: v["prompt"] for k, v in reported.items()}
    r = usage(server, {**bearer["carol"], "Accept": "text/csv"})
    assert r.headers["content-type"].startswith("text/csv")
    assert [x["owner"] for x in csv.DictReader(io.StringIO(r.text))] == ["carol"]


def test_metrics_owner_label_is_capped(server: Server, reported: dict[str, Any]) -> None:
    text = httpx.get(server.url + "/metrics", headers=server.admin_headers, timeout=10).text
    # usage_metric_top_owners 1: carol, seen first, keeps her name; dave is "other".
    carol, dave = reported["carol"], reported["dave"]
    assert (f'modelyard_usage_tokens_total{{kind="completion",model="m",owner="carol"}} '
            f'{float(carol["completion"])}') in text
    assert (f'modelyard_usage_tokens_total{{kind="cached",model="m",owner="other"}} '
            f'{float(dave["cached"])}') in text
    assert 'modelyard_usage_requests_total{model="m",owner="other"} 1.0' in text
    assert 'owner="dave"' not in text


def test_restart_keeps_the_counts(start_server: Any) -> None:
    cfg = config(fake_model("m"), usage_flush_interval_s=3600)
    first = start_server(cfg, "--single-process")
    r = httpx.post(first.url + "/v1/chat/completions", timeout=60,
                   json={"model": "m", "messages": HELLO, "max_tokens": 3})
    assert r.status_code == 200, r.text
    reported = r.json()["usage"]
    first.stop()  # SIGTERM, a clean stop: the last flush
    # The same home: a new server process on the first one's database.
    second = Server(first.home, cfg, "--single-process")
    try:
        second.wait_healthy()
        [row] = usage(second, {}, group_by="model").json()["data"]
        assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == \
            (1, reported["prompt_tokens"], reported["completion_tokens"])
    finally:
        second.stop()


def test_the_cli(server: Server, bearer: Any, reported: dict[str, dict[str, int]]) -> None:
    def cli(*args: str, token: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "MODELYARD_TOKEN": token, "MODELYARD_HOME": str(server.home)}
        return subprocess.run([sys.executable, "-m", "modelyard", "usage", "--url", server.url,
                               *args], env=env, capture_output=True, text=True, timeout=60,
                              check=False)

    admin = server.admin_headers["Authorization"].removeprefix("Bearer ")
    done = cli("--csv", "--since", "2h", token=admin)
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    assert {x["owner"]: int(x["completion_tokens"]) for x in rows} == \
        {k: v["completion"] for k, v in reported.items()}
    carol = bearer["carol"]["Authorization"].removeprefix("Bearer ")
    done = cli("--group-by", "user", token=carol)
    assert done.returncode == 0, done.stderr
    assert "carol" in done.stdout and "dave" not in done.stdout
    done = cli("--owner", "dave", token=carol)
    assert done.returncode == 1 and "your own usage" in done.stderr


@covers("Usage per user and token (`GET /v1/usage`)", "OpenAI", "Ollama", "Anthropic")
def test_every_api_is_counted_with_the_tokens_it_reported(server: Server, bearer: Any,
                                                          reported: Any) -> None:
    """One request through each API family, as erin: each is a row of its `api` whose tokens are
    those that API's answer reported to the client."""
    admin = httpx.Client(base_url=server.url, headers=server.admin_headers, timeout=60)
    with admin:
        r = admin.post("/admin/users", json={"name": "erin", "password": "erin-pw-123",
                                              "must_change_password": False})
        assert r.status_code in (200, 201), r.text
        token = admin.post("/tokens", json={"name": "erin-t", "owner": "erin"}).json()["token"]
    erin = {"Authorization": f"Bearer {token}"}
    said: dict[str, tuple[int, int]] = {}
    r = httpx.post(server.url + "/v1/chat/completions", headers=erin, timeout=60,
                   json={"model": "m", "messages": HELLO, "max_tokens": 2})
    said["openai"] = (r.json()["usage"]["prompt_tokens"], r.json()["usage"]["completion_tokens"])
    r = httpx.post(server.url + "/api/chat", headers=erin, timeout=60,
                   json={"model": "m", "messages": HELLO, "stream": False,
                         "options": {"num_predict": 3}})
    said["ollama"] = (r.json()["prompt_eval_count"], r.json()["eval_count"])
    r = httpx.post(server.url + "/v1/messages", headers=erin, timeout=60,
                   json={"model": "m", "messages": HELLO, "max_tokens": 4})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    # Anthropic's input_tokens leaves out the cached ones (cache_read_input_tokens).
    said["anthropic"] = (u["input_tokens"] + u.get("cache_read_input_tokens", 0),
                         u["output_tokens"])
    r = httpx.post(server.url + "/v1/responses", headers=erin, timeout=60,
                   json={"model": "m", "input": HELLO, "max_output_tokens": 5, "store": False})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    said["openai"] = (said["openai"][0] + u["input_tokens"], said["openai"][1] + u["output_tokens"])
    rows = usage(server, erin, group_by="api").json()["data"]
    assert {x["api"]: (x["prompt_tokens"], x["completion_tokens"]) for x in rows} == said
    assert [said[a][1] for a in ("openai", "ollama", "anthropic")] == [2 + 5, 3, 4]
    [total] = usage(server, erin, group_by="").json()["data"]
    assert total["requests"] == 4
