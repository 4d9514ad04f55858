"""The batch API against a real front and fake llama-server processes on a simulated GPU where
only two of the three models fit: outputs by custom_id, fewer loads than the same requests sent
one by one, bad files, cancel, ownership, and a restarted front resuming a batch."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.harness import config, module_server, starts
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

GIB = 2**30
MODELS = ("bm-a", "bm-b", "bm-c")
MAX_BODY_BYTES = 16 * 1024  # small, so that an upload over it is cheap to send
FILES_MAX_BYTES = 512 * 1024
WORDS = ("The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "by", "a",
         "river")


def _model(model_id: str, files: Path, *flags: str) -> dict[str, Any]:
    nbytes = 3 * GIB  # two of three fit the 8 GiB device
    return fake_model(model_id, "--claim-bytes", str(nbytes), "--start-log",
                      str(files / f"{model_id}.starts"), *flags, vram_bytes=nbytes)


def _loads(files: Path) -> int:
    return sum(len(starts(files / f"{m}.starts")) for m in MODELS)


def _line(i: int, model: str) -> dict[str, Any]:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": 1 + i % 5,
                     "messages": [{"role": "user", "content": "hi"}]}}


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def _upload(server: Server, data: bytes, headers: dict[str, str] | None = None
            ) -> httpx.Response:
    return httpx.post(server.url + "/v1/files", headers=headers or {}, timeout=30,
                      files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})


def _start(server: Server, data: bytes, headers: dict[str, str] | None = None
           ) -> dict[str, Any]:
    up = _upload(server, data, headers)
    assert up.status_code == 200, up.text
    r = httpx.post(server.url + "/v1/batches", headers=headers or {}, timeout=30, json={
        "input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "validating"
    return dict(r.json())


def _wait(server: Server, batch_id: str, *statuses: str, timeout_s: float = 60
          ) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = httpx.get(f"{server.url}/v1/batches/{batch_id}", timeout=10).json()
        if batch["status"] in statuses or time.monotonic() > deadline:
            assert batch["status"] in statuses, batch
            return dict(batch)
        time.sleep(0.1)


def _content(server: Server, file_id: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{server.url}/v1/files/{file_id}/content", timeout=10)
    assert r.status_code == 200, r.text
    return {x["custom_id"]: x for x in map(json.loads, r.text.splitlines())}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, files: Path) -> Iterator[Server]:
    cfg = config(*(_model(m, files) for m in MODELS), simulate_gpus="1x8GiB",
                 max_body_bytes=MAX_BODY_BYTES, files_max_bytes=FILES_MAX_BYTES)
    with module_server(tmp_path_factory, cfg, "--single-process") as s:
        yield s


def test_a_batch_over_three_models_loads_fewer_times_than_one_by_one(
    server: Server, files: Path
) -> None:
    # Interleaved a, b, c, a, b, c…: in the file's order every request needs a swap.
    lines = [_line(i, MODELS[i % 3]) for i in range(12)]
    before = _loads(files)
    batch = _start(server, _jsonl(lines))
    done = _wait(server, batch["id"], "completed")
    batch_loads = _loads(files) - before
    assert done["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    assert done["error_file_id"] is None  # no error: no error file, as OpenAI
    out = _content(server, done["output_file_id"])
    assert sorted(out) == sorted(x["custom_id"] for x in lines)
    for x in lines:
        response = out[x["custom_id"]]["response"]
        assert response["status_code"] == 200
        assert response["body"]["model"] == x["body"]["model"]
        text = response["body"]["choices"][0]["message"]["content"]
        assert text == " ".join(WORDS[: x["body"]["max_tokens"]])
        assert out[x["custom_id"]]["error"] is None
    before = _loads(files)
    for x in lines:  # the same requests, one by one in the file's order
        r = httpx.post(server.url + x["url"], json=x["body"], timeout=30)
        assert r.status_code == 200, r.text
    one_by_one = _loads(files) - before
    assert batch_loads <= 3, batch_loads
    assert batch_loads < one_by_one, (batch_loads, one_by_one)


@pytest.mark.parametrize(("lines", "code_line"), [
    ([b"{not json"], "line 1"),
    ([json.dumps(_line(1, "bm-a")).encode(), json.dumps(_line(1, "bm-b")).encode()], "line 2"),
    ([json.dumps({**_line(1, "bm-a"), "url": "/v1/moderations"}).encode()], "line 1"),
    ([json.dumps({**_line(1, "bm-a"), "method": "GET"}).encode()], "line 1"),
    ([json.dumps({**_line(1, "bm-a"), "body": {"messages": []}}).encode()], "line 1"),
])
def test_a_bad_batch_file_is_a_400_naming_the_line(
    server: Server, lines: list[bytes], code_line: str
) -> None:
    r = _upload(server, b"\n".join(lines) + b"\n")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_batch_file"
    assert r.json()["error"]["param"] == code_line


def test_an_upload_is_held_to_files_max_bytes_not_max_body_bytes(server: Server) -> None:
    padded = [{**_line(i, "bm-a"), "body": {"model": "bm-a", "messages": [
        {"role": "user", "content": "x" * 1000}]}} for i in range(100)]
    data = _jsonl(padded)
    assert MAX_BODY_BYTES < len(data) < FILES_MAX_BYTES
    r = _upload(server, data)
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == len(data)
    # Just over: the form around it still fits the transport's slack, the store refuses it.
    # Far over: refused from its Content-Length before any of it is read.
    for size in (FILES_MAX_BYTES + 1, 2 * FILES_MAX_BYTES):
        r = _upload(server, b"x" * size)
        assert r.status_code == 413, (size, r.text)
        assert r.json()["error"]["code"] == "payload_too_large"
        assert "files_max_bytes" in r.json()["error"]["message"], (size, r.text)
    # Other routes keep max_body_bytes.
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "bm-a", "messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}]})
    assert r.status_code == 413, r.text
    assert "max_body_bytes" in r.json()["error"]["message"]


def test_a_batch_naming_another_endpoint_than_its_lines_is_a_400(server: Server) -> None:
    up = _upload(server, _jsonl([_line(1, "bm-a")]))
    r = httpx.post(server.url + "/v1/batches", timeout=10, json={
        "input_file_id": up.json()["id"], "endpoint": "/v1/embeddings"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_batch_file"


def test_another_user_cannot_see_my_file_or_batch(server: Server) -> None:
    admin = server.admin_headers
    r = httpx.post(server.url + "/admin/users", headers=admin, timeout=10, json={
        "name": "bob", "password": "correct horse battery", "must_change_password": False})
    assert r.status_code == 201, r.text
    r = httpx.post(server.url + "/tokens", headers=admin, timeout=10,
                   json={"name": "bob-key", "owner": "bob", "scopes": ["inference"]})
    assert r.status_code == 201, r.text
    bob = {"Authorization": f"Bearer {r.json()['token']}"}
    batch = _start(server, _jsonl([_line(1, "bm-a")]))  # anonymous (loopback, auth auto)
    for path in (f"/v1/batches/{batch['id']}", f"/v1/files/{batch['input_file_id']}",
                 f"/v1/files/{batch['input_file_id']}/content"):
        r = httpx.get(server.url + path, headers=bob, timeout=10)
        assert r.status_code == 404, (path, r.text)
    r = httpx.post(f"{server.url}/v1/batches/{batch['id']}/cancel", headers=bob, timeout=10)
    assert r.status_code == 404
    assert httpx.get(server.url + "/v1/batches", headers=bob, timeout=10).json()["data"] == []
    seen = httpx.get(server.url + "/v1/batches", headers=admin, timeout=10).json()["data"]
    assert batch["id"] in {b["id"] for b in seen}  # admins see every batch
    _wait(server, batch["id"], "completed")


def test_cancel_stops_a_batch_and_keeps_what_finished(server: Server) -> None:
    lines = [_line(i, "bm-a") for i in range(40)]
    batch = _start(server, _jsonl(lines))
    r = httpx.post(f"{server.url}/v1/batches/{batch['id']}/cancel", timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["status"] in ("cancelling", "cancelled")
    done = _wait(server, batch["id"], "cancelled")
    counts = done["request_counts"]
    assert counts["completed"] < 40
    assert len(_content(server, done["output_file_id"])) == counts["completed"]
    again = httpx.post(f"{server.url}/v1/batches/{batch['id']}/cancel", timeout=10)
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "batch_finished"


def test_a_restarted_front_resumes_its_batch(
    tmp_path_factory: pytest.TempPathFactory, files: Path
) -> None:
    slow = fake_model("bm-slow", "--tokens-per-s", "20")
    home = tmp_path_factory.mktemp("resume")
    cfg = config(slow)
    lines = [_line(i, "bm-slow") for i in range(16)]
    first = Server(home, cfg, "--single-process")
    try:
        first.wait_healthy()
        batch = _start(first, _jsonl(lines))
        deadline = time.monotonic() + 30
        while httpx.get(f"{first.url}/v1/batches/{batch['id']}", timeout=10
                        ).json()["request_counts"]["completed"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        first.stop()
    second = Server(home, cfg, "--single-process")
    try:
        second.wait_healthy()
        done = _wait(second, batch["id"], "completed")
        assert done["request_counts"] == {"total": 16, "completed": 16, "failed": 0}
        out = _content(second, done["output_file_id"])
        assert sorted(out) == sorted(x["custom_id"] for x in lines)  # each once, none lost
    finally:
        second.stop()


def _completed(server: Server, batch_id: str) -> int:
    r = httpx.get(f"{server.url}/v1/batches/{batch_id}", timeout=10)
    return int(r.json()["request_counts"]["completed"])


def test_an_interactive_request_is_served_ahead_of_a_running_batch(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # One slot on the model and 0.25 s a line (5 tokens at 20/s): the order is observable. With
    # six batch lines allowed in flight, a request queued behind them (FIFO, no priority, no
    # holding back of the batch) would see about six more lines finish before its answer.
    one_slot = fake_model("bm-one", "--tokens-per-s", "20", max_concurrency=1)
    cfg = config(one_slot, batch_max_concurrency=6)
    lines = [{**_line(i, "bm-one"), "body": {
        "model": "bm-one", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}}
        for i in range(20)]
    server = Server(tmp_path_factory.mktemp("interactive"), cfg, "--single-process")
    try:
        server.wait_healthy()
        batch = _start(server, _jsonl(lines))
        deadline = time.monotonic() + 30
        while _completed(server, batch["id"]) < 2:  # loaded, lines flowing
            assert time.monotonic() < deadline
            time.sleep(0.05)
        before = _completed(server, batch["id"])
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "model": "bm-one", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
        after = _completed(server, batch["id"])
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == " ".join(WORDS[:5])
        # At most the line that held the slot when it came (+1 whose count landed late).
        assert after - before <= 2, (before, after)
        assert after < len(lines)  # the batch's later lines ran after it
        done = _wait(server, batch["id"], "completed")
        assert done["request_counts"]["completed"] == len(lines)
    finally:
        server.stop()
