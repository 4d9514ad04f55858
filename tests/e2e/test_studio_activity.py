"""End to end: the Studio's Activity page in a real browser (Debian's chromium, Playwright)
against a real modelyard with fake backends: the recent requests load, a request made while
the page is open arrives over the live feed, and a row's detail shows its captured bodies,
redacted. Screenshots go to $MODELYARD_ARTIFACTS/studio (default test-artifacts/studio/)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, sync_playwright
from tests.e2e.test_studio import CHROMIUM, CHROMIUM_ARGS, Console, login, shot
from tests.integration.harness import HELLO, config
from tests.support import Server, fake_model, require_e2e_artifact

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SECRET = "hunter2-in-the-body"
PASSWORD = "ops-password-for-tests"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_e2e_artifact(CHROMIUM if CHROMIUM.exists() else None, "Debian's chromium")
    cfg = config(fake_model("quick"), fake_model("slowish", "--tokens-per-s", "40"))
    s = Server(tmp_path_factory.mktemp("activity"), cfg, "--single-process")
    try:
        s.wait_healthy()
        r = httpx.post(s.url + "/admin/users", headers=s.admin_headers, timeout=10,
                       json={"name": "ops", "password": PASSWORD, "is_admin": True,
                             "must_change_password": False})
        assert r.status_code == 201, r.text
        yield s
    finally:
        s.stop()


def chat(server: Server, model: str, **headers: str) -> httpx.Response:
    body: dict[str, Any] = {"model": model, "messages": HELLO, "max_tokens": 6,
                            "api_key": SECRET}
    r = httpx.post(server.url + "/v1/chat/completions", json=body,
                   headers={**server.admin_headers, **headers}, timeout=30)
    assert r.status_code == 200, r.text
    return r


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


def test_the_activity_page_is_live_and_shows_captured_bodies(
        server: Server, page: tuple[Page, Console]) -> None:
    p, _ = page
    captured = chat(server, "quick", **{"X-Modelyard-Capture": "on"})
    chat(server, "slowish")
    login(p, server.url, "ops", PASSWORD)
    p.wait_for_selector("nav")
    p.click("nav a[href='#/activity']")
    p.wait_for_selector(".live-pill.on")  # following the feed
    # the list is fetched beside the feed: wait for its rows, not for the pill alone
    p.wait_for_function("() => document.querySelectorAll('tr.activity-row').length === 2")
    rows = p.locator("tr.activity-row")
    assert "quick" in rows.nth(1).inner_text() and "slowish" in rows.nth(0).inner_text()

    live = chat(server, "quick")  # arrives over the feed, on top
    p.wait_for_function("() => document.querySelectorAll('tr.activity-row').length === 3")
    assert rows.first.get_attribute("data-id") == live.headers["x-request-id"]
    shot(p, "activity-live")

    p.locator(f"tr.activity-row[data-id='{captured.headers['x-request-id']}']").click()
    dialog = p.locator("dialog.activity-detail")
    dialog.locator("pre.activity-body").first.wait_for()
    text = dialog.inner_text()
    assert "Request body" in text and "Response body" in text
    assert "[redacted]" in text and SECRET not in text
    shot(p, "activity-detail")
