"""End to end: the Studio's Batches page in a real browser (Debian's chromium, Playwright)
against a real modelyard with fake backends: a batch made by the API shows up and completes
(the page polls while it runs) with its output file to download; a bad JSONL uploaded from the
page shows the API's message naming the line; a long batch started from the page is cancelled
from it. Screenshots go to $MODELYARD_ARTIFACTS/studio (default test-artifacts/studio/)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, sync_playwright
from tests.e2e.test_studio import CHROMIUM, CHROMIUM_ARGS, Console, login, shot
from tests.integration.harness import HELLO, config, module_server
from tests.support import Server, fake_model, require_e2e_artifact

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PASSWORD = "ops-password-for-tests"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_e2e_artifact(CHROMIUM if CHROMIUM.exists() else None, "Debian's chromium")
    # "slow": 10 tokens/s, so a batch of its lines runs long enough to be cancelled.
    cfg = config(fake_model("quick"), fake_model("slow", "--tokens-per-s", "10"))
    with module_server(tmp_path_factory, cfg, "--single-process") as s:
        r = httpx.post(s.url + "/admin/users", headers=s.admin_headers, timeout=10,
                       json={"name": "ops", "password": PASSWORD, "is_admin": True,
                             "must_change_password": False})
        assert r.status_code == 201, r.text
        yield s


def jsonl(model: str, n: int, max_tokens: int = 4) -> bytes:
    return b"".join(json.dumps({
        "custom_id": f"{model}-<b>{i}</b>", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": model, "max_tokens": max_tokens, "messages": HELLO}}).encode() + b"\n"
        for i in range(n))


def api_batch(server: Server, data: bytes) -> dict[str, Any]:
    up = httpx.post(server.url + "/v1/files", headers=server.admin_headers, timeout=30,
                    files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    assert up.status_code == 200, up.text
    r = httpx.post(server.url + "/v1/batches", headers=server.admin_headers, timeout=30,
                   json={"input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions"})
    assert r.status_code == 200, r.text
    return dict(r.json())


def wait_status(server: Server, batch_id: str, status: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        now = httpx.get(f"{server.url}/v1/batches/{batch_id}", headers=server.admin_headers,
                        timeout=10).json()["status"]
        if now == status or time.monotonic() > deadline:
            assert now == status, (batch_id, now)
            return
        time.sleep(0.1)  # the API has no event to await: poll it, as test_batches does


@pytest.fixture
def page(server: Server) -> Iterator[tuple[Page, Console]]:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 900},
                                          color_scheme="dark")
            context.set_default_timeout(30_000)
            p = context.new_page()
            console = Console(p)
            yield p, console
            assert console.errors == [], console.errors
        finally:
            browser.close()


def upload(p: Page, name: str, data: bytes) -> None:
    p.set_input_files("input[type=file]", {"name": name, "mimeType": "application/jsonl",
                                           "buffer": data})
    p.click("button:has-text('Upload and start')")


def test_batches_complete_fail_to_upload_and_cancel_from_the_page(
        server: Server, page: tuple[Page, Console]) -> None:
    p, _ = page
    done = api_batch(server, jsonl("quick", 3))
    login(p, server.url, "ops", PASSWORD)
    p.wait_for_selector("nav")
    p.click("nav a[href='#/batches']")

    # The API's batch completes on the page (it polls while the batch is active).
    row = p.locator(f"tr.batch-row[data-id='{done['id']}']")
    p.wait_for_selector(f"tr.batch-row[data-id='{done['id']}'][data-status='completed']",
                        timeout=60_000)
    assert row.locator(".batch-counts").inner_text() == "3/0/3"
    assert row.locator("[role=progressbar]").get_attribute("aria-valuenow") == "100.0"
    assert "admin" in row.inner_text()  # the owner column, for an admin
    link = row.locator("a[data-file='Output']")
    href = link.get_attribute("href")
    assert href == f"/v1/files/{done['output_file_id']}/content"
    assert row.locator("a[data-file='Errors']").count() == 0  # none failed: no error file
    assert row.locator("button[data-action='cancel']").count() == 0
    # The plain link downloads with the session cookie: the browser's own request.
    got = p.request.get(server.url + href)
    assert got.ok, got.text()
    ids = sorted(json.loads(x)["custom_id"] for x in got.text().splitlines())
    assert ids == [f"quick-<b>{i}</b>" for i in range(3)]
    shot(p, "batches-completed")

    # A bad file: the API's 400, naming its line, in the form.
    bad = jsonl("quick", 1) + b'{"custom_id": "x", "method": "POST"\n'
    upload(p, "bad.jsonl", bad)
    error = p.locator("form .alert.error")
    error.wait_for()
    assert "line 2" in error.inner_text()
    shot(p, "batches-bad-file")

    # A long batch started from the page (a cookie upload), then cancelled from it.
    upload(p, "long.jsonl", jsonl("slow", 30, max_tokens=20))
    p.wait_for_function("() => document.querySelectorAll('tr.batch-row').length === 2")
    assert error.count() == 0  # the next try cleared the last error
    long_row = p.locator("tr.batch-row").first
    long_id = long_row.get_attribute("data-id")
    assert long_id and long_id != done["id"]
    assert "/v1/chat/completions" in long_row.inner_text()  # the endpoint: the first line's url
    long_row.locator("button[data-action='cancel']").click()
    dialog = p.locator("dialog")
    dialog.wait_for()
    shot(p, "batches-cancel-confirm")
    dialog.locator("button:has-text('Cancel batch')").click()
    p.wait_for_selector(f"tr.batch-row[data-id='{long_id}'][data-status='cancelled']",
                        timeout=60_000)
    counts = long_row.locator(".batch-counts").inner_text().split("/")
    assert counts[2] == "30" and int(counts[0]) < 30, counts
    assert long_row.locator("a[data-file='Output']").count() == 1
    shot(p, "batches-cancelled")
    # Escaped: a custom id with markup came back as text, never as elements.
    assert p.locator("tr.batch-row b").count() == 0


def test_a_refused_cancel_shows_the_api_message(
        server: Server, page: tuple[Page, Console]) -> None:
    p, _ = page
    running = api_batch(server, jsonl("slow", 20, max_tokens=20))
    # The page's view of the list, taken while the batch still runs, is served to the page
    # from here on: it keeps its Cancel button after the batch is over (as a page does that
    # has not polled yet), and its cancel goes to the real server.
    stale = httpx.get(server.url + "/v1/batches?limit=100", headers=server.admin_headers,
                      timeout=10)
    assert stale.status_code == 200, stale.text
    r = httpx.post(f"{server.url}/v1/batches/{running['id']}/cancel",
                   headers=server.admin_headers, timeout=10)
    assert r.status_code == 200, r.text
    # cancelling (the runner finishing its lines in flight) still accepts a cancel: only a
    # finished batch refuses one, so the page tries once it is over.
    wait_status(server, running["id"], "cancelled")
    p.route("**/v1/batches?limit=100", lambda route: route.fulfill(
        status=200, content_type="application/json", body=stale.content))
    login(p, server.url, "ops", PASSWORD)
    p.wait_for_selector("nav")
    p.click("nav a[href='#/batches']")
    row = p.locator(f"tr.batch-row[data-id='{running['id']}']")
    row.locator("button[data-action='cancel']").click()
    p.locator("dialog button:has-text('Cancel batch')").click()
    error = p.locator(".alert.error")
    error.wait_for()
    text = error.inner_text()
    assert f"batch {running['id']} is" in text and "nothing to cancel" in text, text
    shot(p, "batches-cancel-refused")
