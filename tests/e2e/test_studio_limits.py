"""End to end: the Studio's Limits page in a real browser (Debian's chromium, Playwright) against
a real `modelyard serve` over a fake model: an admin sets a user's limit in the form, the table
shows it with what the user used, a user is put in a group, and a limit is removed. The page is
saved as a screenshot under $MODELYARD_ARTIFACTS/studio (default test-artifacts/studio/)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, expect, sync_playwright
from tests.e2e.test_studio import CHROMIUM, CHROMIUM_ARGS, Console, shot
from tests.integration.harness import HELLO, config, module_server
from tests.support import Server, fake_model, require_e2e_artifact

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PASSWORD = "a-password-of-my-own"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_e2e_artifact(CHROMIUM if CHROMIUM.exists() else None, "Debian's chromium")
    cfg = config(fake_model("m1"), limits_refresh_s=0.5)
    with module_server(tmp_path_factory, cfg, "--single-process") as started:
        yield started


def api(server: Server, method: str, path: str, **kwargs: Any) -> httpx.Response:
    r = httpx.request(method, server.url + path, headers=server.admin_headers, timeout=30,
                      **kwargs)
    assert r.status_code < 300, r.text
    return r


@pytest.fixture
def page() -> Iterator[Page]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1400, "height": 900},
                                      color_scheme="dark")
        context.set_default_timeout(30_000)
        p = context.new_page()
        console = Console(p)
        try:
            yield p
        finally:
            browser.close()
        assert console.errors == [], console.errors


def test_an_admin_sets_limits_and_groups_in_the_studio(server: Server, page: Page) -> None:
    api(server, "POST", "/admin/users", json={"name": "boss", "password": PASSWORD,
                                              "is_admin": True, "must_change_password": False})
    api(server, "POST", "/admin/users", json={"name": "zoe", "password": PASSWORD})
    token = api(server, "POST", "/tokens", json={"name": "t", "owner": "zoe"}).json()["token"]

    page.goto(server.url + "/")
    page.fill("input[name=username]", "boss")
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.click("nav a[data-page=limits]")
    page.wait_for_selector(".page[data-page=limits] h1")
    page.wait_for_selector(".page[data-page=limits] .empty")  # nobody is limited yet

    page.select_option("select[name=kind]", "user")
    page.fill("input[name=subject_name]", "zoe")
    page.fill("input[name=requests_per_minute]", "3")
    page.fill("input[name=max_concurrent]", "2")
    page.fill("input[name=max_num_ctx]", "8192")
    page.click("button:has-text('Save limit')")
    row = page.locator("tr[data-subject='user:zoe']")
    row.wait_for()
    [limit] = api(server, "GET", "/admin/limits").json()["limits"]
    assert (limit["requests_per_minute"], limit["tokens_per_day"],
            limit["max_concurrent"], limit["max_num_ctx"]) == (3, None, 2, 8192)
    assert "8192" in row.locator("td").nth(4).inner_text()

    # Zoe's request shows up as used in the table (after Refresh). The counter is this
    # wall-clock minute's, so the request is not sent in a minute's last seconds (where the
    # table could already show the next minute's 0: the fresh-clone CI's failure on 149152b).
    seconds_left = 60 - time.time() % 60
    if seconds_left < 15:
        time.sleep(seconds_left + 0.1)  # a clock boundary, not an event: nothing to await
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   headers={"Authorization": f"Bearer {token}"},
                   json={"model": "m1", "messages": HELLO, "max_tokens": 2})
    assert r.status_code == 200 and r.headers["X-RateLimit-Remaining"] == "2", r.text
    page.click("button:has-text('Refresh')")
    # Waits for the refreshed table: "0 / 3" was already there before the click.
    expect(row.locator("td").nth(1)).to_have_text(re.compile(r"^\s*1\s*/\s*3\s*$"))

    page.click("tr[data-user=zoe] button[data-action=group]")
    page.fill("dialog input", "research")
    page.click("dialog button:has-text('Save')")
    page.wait_for_selector("tr[data-user=zoe] >> text=research")
    assert api(server, "GET", "/admin/users").json()["users"][-1]["group"] == "research"

    page.select_option("select[name=kind]", "group")
    page.fill("input[name=subject_name]", "research")
    page.fill("input[name=requests_per_minute]", "")
    page.fill("input[name=max_concurrent]", "")
    page.fill("input[name=tokens_per_day]", "100000")
    page.click("button:has-text('Save limit')")
    page.wait_for_selector("tr[data-subject='group:research']")
    shot(page, "30-limits")

    page.click("tr[data-subject='user:zoe'] button[data-action=delete]")
    page.click("dialog button:has-text('Remove')")
    page.wait_for_selector("tr[data-subject='user:zoe']", state="detached")
    subjects = [x["subject"] for x in api(server, "GET", "/admin/limits").json()["limits"]]
    assert subjects == ["group:research"]
    shot(page, "31-limits-after-remove")
