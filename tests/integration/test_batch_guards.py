"""The batch API's guards against a real front and fake llama-server processes (issue 31): a bad
multipart form is a 4xx, a full disk a 507, downloads are attachments, an owner's files and open
batches are bounded, a batch waits out its owner's limit instead of failing its lines, the runner
is shared fairly between owners, and a 100k-line batch does not grow the front's memory."""

from __future__ import annotations

import json
import resource
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.harness import config, module_server
from tests.support import Server, fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

FILES_MAX_BYTES = 512 * 1024
QUOTA_BYTES = 64 * 1024


def _line(i: int, model: str, max_tokens: int = 1) -> dict[str, Any]:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": max_tokens,
                     "messages": [{"role": "user", "content": "hi"}]}}


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def _upload(server: Server, data: bytes, headers: dict[str, str] | None = None
            ) -> httpx.Response:
    return httpx.post(server.url + "/v1/files", headers=headers or {}, timeout=60,
                      files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})


def _create(server: Server, file_id: str, headers: dict[str, str] | None = None
            ) -> httpx.Response:
    return httpx.post(server.url + "/v1/batches", headers=headers or {}, timeout=60, json={
        "input_file_id": file_id, "endpoint": "/v1/chat/completions"})


def _start(server: Server, data: bytes, headers: dict[str, str] | None = None
           ) -> dict[str, Any]:
    up = _upload(server, data, headers)
    assert up.status_code == 200, up.text
    r = _create(server, up.json()["id"], headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _batch(server: Server, batch_id: str, headers: dict[str, str] | None = None
           ) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/v1/batches/{batch_id}", headers=headers or {}, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _user(server: Server, name: str) -> dict[str, str]:
    admin = server.admin_headers
    r = httpx.post(server.url + "/admin/users", headers=admin, timeout=10, json={
        "name": name, "password": "correct horse battery", "must_change_password": False})
    assert r.status_code == 201, r.text
    r = httpx.post(server.url + "/tokens", headers=admin, timeout=10,
                   json={"name": f"{name}-key", "owner": name, "scopes": ["inference"]})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['token']}", "X-Token-Id": r.json()["id"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = config(fake_model("bg-a"), fake_model("bg-slow", "--tokens-per-s", "20"),
                 files_max_bytes=FILES_MAX_BYTES,
                 files_max_total_bytes_per_owner=QUOTA_BYTES, batches_max_open_per_owner=2)
    with module_server(tmp_path_factory, cfg, "--single-process") as s:
        yield s


# ---- item 4: a bad form is a 4xx, a full disk a 507 -----------------------------------------

def _form(*parts: bytes, boundary: bytes = b"xyz") -> bytes:
    return b"".join(b"--" + boundary + b"\r\n" + p + b"\r\n" for p in parts) \
        + b"--" + boundary + b"--\r\n"


FILE_PART = b'Content-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n' \
    + json.dumps(_line(1, "bg-a")).encode()
PURPOSE = b'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch'


@pytest.mark.parametrize(("content_type", "body", "what"), [
    ("multipart/form-data", _form(FILE_PART, PURPOSE), "no boundary"),
    ("multipart/form-data; boundary=xyz", _form(FILE_PART, FILE_PART, PURPOSE),
     "two `file` parts"),
    ("multipart/form-data; boundary=xyz",
     _form(*[b'Content-Disposition: form-data; name="f%d"\r\n\r\nx' % i for i in range(2000)]),
     "over 4 parts"),
    ("multipart/form-data; boundary=xyz",
     _form(b'Content-Disposition: form-data; name="file"; filename="' + b"a" * 20_000
           + b'"\r\n\r\nx', PURPOSE), "malformed"),
    ("multipart/form-data; boundary=xyz", b"--xyz\r\nContent-Disposition: form-data; "
     b'name="purpose"\r\n\r\nbatch', "ends before its closing boundary"),
])
def test_a_bad_multipart_form_is_a_400_invalid_upload(
    server: Server, content_type: str, body: bytes, what: str
) -> None:
    r = httpx.post(server.url + "/v1/files", content=body, timeout=30,
                   headers={"Content-Type": content_type})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_upload"
    assert what in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_a_full_disk_on_upload_is_a_507_and_keeps_nothing(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # A file size limit on the front (ulimit -f): a write past it fails with EFBIG, as a full
    # disk fails with ENOSPC (Python ignores SIGXFSZ). The database and log stay far below it.
    limit = 2 * 1024 * 1024

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    home = tmp_path_factory.mktemp("full")
    front = Server(home, config(files_max_bytes=8 * limit), "--single-process",
                   preexec_fn=small_files)
    try:
        front.wait_healthy()
        data = _jsonl([{**_line(i, "bg-a"), "pad": "x" * 200} for i in range(4 * limit // 250)])
        assert len(data) > limit
        r = _upload(front, data)
        assert r.status_code == 507, r.text
        assert r.json()["error"]["code"] == "insufficient_storage"
        assert "disk holding the files" in r.json()["error"]["message"]
        assert list((home / "files").iterdir()) == []  # the partial file is gone
        assert httpx.get(front.url + "/v1/files", timeout=10).json()["data"] == []
    finally:
        front.stop()


# ---- item 9: a download is an attachment -----------------------------------------------------

def test_file_content_is_an_attachment_never_sniffed(server: Server) -> None:
    up = _upload(server, _jsonl([_line(1, "bg-a")]))
    assert up.status_code == 200, up.text
    r = httpx.get(f"{server.url}/v1/files/{up.json()['id']}/content", timeout=10)
    assert r.status_code == 200
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["content-disposition"].startswith("attachment")
    assert httpx.delete(f"{server.url}/v1/files/{up.json()['id']}", timeout=10).is_success


# ---- item 2: what one owner may hold ----------------------------------------------------------

def test_an_owner_over_the_files_quota_gets_413_files_over_quota(server: Server) -> None:
    carol = _user(server, "carol")
    chunk = _jsonl([{**_line(i, "bg-a"), "pad": "x" * 900} for i in range(24)])  # ~24 KiB
    kept = []
    for _ in range(2):
        r = _upload(server, chunk, carol)
        assert r.status_code == 200, r.text
        kept.append(r.json()["id"])
    r = _upload(server, chunk, carol)  # 72 KiB > 64 KiB
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "files_over_quota"
    assert "files_max_total_bytes_per_owner" in r.json()["error"]["message"]
    assert _upload(server, chunk).status_code == 200  # another owner is not held to carol's
    r = httpx.delete(f"{server.url}/v1/files/{kept[0]}", headers=carol, timeout=10)
    assert r.status_code == 200
    assert _upload(server, chunk, carol).status_code == 200


def test_an_owner_with_too_many_open_batches_gets_429(server: Server) -> None:
    dave = _user(server, "dave")
    # 20 lines of 2 s each (40 tokens at 20/s) on two slots: each batch stays open 20 s or
    # more, far longer than the three creates take.
    up = _upload(server, _jsonl([_line(i, "bg-slow", 40) for i in range(10)]), dave)
    assert up.status_code == 200, up.text
    opened = []
    for _ in range(2):
        r = _create(server, up.json()["id"], dave)
        assert r.status_code == 200, r.text
        opened.append(r.json()["id"])
    r = _create(server, up.json()["id"], dave)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "too_many_open_batches"
    assert "batches_max_open_per_owner" in r.json()["error"]["message"]
    assert "Retry-After" in r.headers
    for batch_id in opened:
        r = httpx.post(f"{server.url}/v1/batches/{batch_id}/cancel", headers=dave, timeout=10)
        assert r.status_code == 200, r.text
    for batch_id in opened:
        poll(lambda b=batch_id: _batch(server, b, dave)["status"] == "cancelled", 30,
             "a cancelled batch to end")
    assert _create(server, up.json()["id"], dave).status_code == 200  # a place is free again


# ---- item 8: a batch waits out its owner's limit; owners share the runner --------------------

def _hold(server: Server, headers: dict[str, str], started: threading.Event,
          outcome: list[int]) -> None:
    """An interactive stream of 8 s that holds the owner's one concurrent slot; refused (429)
    while a batch line holds it, it asks again, as a client would."""
    body = {"model": "bg-hold", "max_tokens": 16, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    while True:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          headers=headers, timeout=60) as r:
            if r.status_code == 429:
                r.read()
                time.sleep(0.1)
                continue
            for _ in r.iter_bytes():
                started.set()
            outcome.append(r.status_code)
            return


def test_a_batch_waits_out_its_owners_limit_instead_of_failing_lines(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    cfg = config(fake_model("bg-hold", "--tokens-per-s", "2"),
                 fake_model("bg-line", "--tokens-per-s", "5"))
    front = Server(tmp_path_factory.mktemp("limited"), cfg, "--single-process")
    try:
        front.wait_healthy()
        bob = _user(front, "bob")
        r = httpx.put(f"{front.url}/admin/limits/token:{bob.pop('X-Token-Id')}",
                      headers=front.admin_headers, json={"max_concurrent": 1}, timeout=10)
        assert r.status_code == 200, r.text
        # 7 lines of 1 s each; the owner may run one request at a time.
        batch = _start(front, _jsonl([_line(i, "bg-line", 5) for i in range(7)]), bob)
        poll(lambda: _batch(front, batch["id"], bob)["request_counts"]["completed"] >= 1, 30,
             "the batch's first line")
        # Now the owner's slot goes to an interactive request for 8 s: every line tried
        # meanwhile is refused 429 (concurrent requests), more than the old runner's six
        # attempts a second apart could outwait.
        started, outcome = threading.Event(), []
        holder = threading.Thread(target=_hold, args=(front, bob, started, outcome))
        holder.start()
        assert started.wait(30)
        holder.join(30)
        assert outcome == [200]
        done = poll(lambda: (b := _batch(front, batch["id"], bob))["status"] in (
            "completed", "failed", "expired", "cancelled") and b, 60, "the batch to end")
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": 7, "completed": 7, "failed": 0}, done
        assert done["error_file_id"] is None  # no line failed rate_limited
    finally:
        front.stop()


def test_a_small_batch_is_not_held_behind_another_owners_big_one(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # A: 60 lines of 0.25 s (5 tokens at 20/s) on two slots, about 8 s. B, another owner's
    # 1 line on another model, comes once A runs: fair turns start it at the next free slot.
    cfg = config(fake_model("bg-big", "--tokens-per-s", "20"), fake_model("bg-small"))
    front = Server(tmp_path_factory.mktemp("fair"), cfg, "--single-process")
    try:
        front.wait_healthy()
        bob = _user(front, "bob")
        bob.pop("X-Token-Id")
        big = _start(front, _jsonl([_line(i, "bg-big", 5) for i in range(60)]))
        poll(lambda: _batch(front, big["id"])["request_counts"]["completed"] >= 2, 30,
             "the big batch to run")
        small = _start(front, _jsonl([_line(0, "bg-small")]), bob)
        done = poll(lambda: (b := _batch(front, small["id"], bob))["status"] == "completed"
                    and b, 60, "the small batch to complete")
        assert done["request_counts"]["completed"] == 1
        big_now = _batch(front, big["id"])
        # Pooled by model, the big batch's model kept the runner until its last line.
        assert big_now["status"] == "in_progress", big_now
        assert big_now["request_counts"]["completed"] < 40, big_now
    finally:
        front.stop()


# ---- item 2: a 100k-line batch does not grow the front's memory -------------------------------

def _kib(pid: int, field: str) -> int:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith(field + ":"):
            return int(row.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_a_100k_line_batch_keeps_the_fronts_memory_flat(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    front = Server(tmp_path_factory.mktemp("memory"), config(fake_model("bg-mem")),
                   "--single-process")
    try:
        front.wait_healthy()
        pid = front.proc.pid
        # Warm: the model loaded, the batch code imported and run once.
        warm = _start(front, _jsonl([_line(i, "bg-mem") for i in range(20)]))
        poll(lambda: _batch(front, warm["id"])["status"] == "completed", 30, "the warm batch")
        start_kib = _kib(pid, "VmRSS")
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from now
        data = _jsonl([_line(i, "bg-mem") for i in range(100_000)])
        assert len(data) > 10 * 2**20
        batch = _start(front, data)
        del data
        # Running: its 100k lines indexed, some done (few: the test's budget is 90 s on a
        # shared machine; the runner holds nothing per line done).
        poll(lambda: _batch(front, batch["id"])["request_counts"]["completed"] >= 100, 45,
             "100 lines to run")
        r = httpx.post(f"{front.url}/v1/batches/{batch['id']}/cancel", timeout=10)
        assert r.status_code == 200, r.text
        done = poll(lambda: (b := _batch(front, batch["id"]))["status"] == "cancelled" and b,
                    30, "the batch to be cancelled")
        assert done["request_counts"]["total"] == 100_000
        peak_mib = (_kib(pid, "VmHWM") - start_kib) / 1024
        end_mib = (_kib(pid, "VmRSS") - start_kib) / 1024
        assert peak_mib < 100, f"the front grew {peak_mib:.0f} MiB at its peak"
        assert end_mib < 100, f"the front kept {end_mib:.0f} MiB"
    finally:
        front.stop()
