"""End to end: the Studio's Usage page in a real browser (Debian's headless chromium driven by
Playwright) against a real modelyard whose model is the fake llama-server process: two users'
requests are drawn as charts over time, per user and per model, listed in the table with the
tokens the backend reported, and downloaded as CSV. A user sees only their own. Screenshots go to
$MODELYARD_ARTIFACTS/studio (default: test-artifacts/studio/)."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright
from tests.e2e.test_studio import CHROMIUM, CHROMIUM_ARGS, Console, login, shot
from tests.integration.harness import HELLO, config, module_server
from tests.support import Server, fake_model, require_e2e_artifact

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

USERS = {"ana": ("ana-password-1", True), "ben": ("ben-password-1", False)}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_e2e_artifact(CHROMIUM if CHROMIUM.exists() else None, "Debian's chromium")
    cfg = config(fake_model("smol"), fake_model("tiny"), auth="required")
    with module_server(tmp_path_factory, cfg, "--single-process") as srv:
        admin = httpx.Client(base_url=srv.url, headers=srv.admin_headers, timeout=30)
        with admin:
            for name, (password, is_admin) in USERS.items():
                r = admin.post("/admin/users", json={"name": name, "password": password,
                                                      "is_admin": is_admin,
                                                      "must_change_password": False})
                assert r.status_code == 201, r.text
                token = admin.post("/tokens", json={"name": f"{name}-app", "owner": name})
                bearer = {"Authorization": f"Bearer {token.json()['token']}"}
                for model, n in (("smol", 3), ("tiny", 1 if name == "ana" else 2)):
                    for _ in range(n):
                        r = httpx.post(srv.url + "/v1/chat/completions", headers=bearer,
                                       timeout=60, json={"model": model, "messages": HELLO,
                                                         "max_tokens": 8 if model == "smol" else 3})
                        assert r.status_code == 200, r.text
        yield srv


@pytest.fixture
def page(tmp_path: Path) -> Iterator[tuple[Page, Console]]:
    with sync_playwright() as pw:
        browser: Browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1400, "height": 900},
                                      color_scheme="dark", accept_downloads=True)
        context.set_default_timeout(30_000)
        p = context.new_page()
        console = Console(p)
        try:
            yield p, console
        finally:
            context.close()
            browser.close()
        assert console.errors == [], console.errors


def test_usage_page_charts_table_and_csv(server: Server, page: tuple[Page, Console]) -> None:
    p, _ = page
    login(p, server.url, "ana", USERS["ana"][0])
    p.wait_for_selector("nav a[data-page=usage]")
    p.click("nav a[data-page=usage]")
    p.wait_for_selector(".page[data-page=usage] table")
    # The table: one row per user and model, with the tokens the backend reported.
    rows = p.locator("tr[data-owner]")
    assert rows.count() == 4
    ben_smol = p.locator("tr[data-owner=ben][data-model=smol] td")
    assert ben_smol.nth(2).inner_text() == "3"  # requests
    assert ben_smol.nth(6).inner_text() == "24"  # completion tokens: 3 requests of 8
    # The charts: bars over time, one bar per user and per model.
    assert p.locator("[data-chart=time] rect").count() >= 2  # new prompt + completion at least
    assert p.locator("[data-chart=user] text.name").all_text_contents() == ["ben", "ana"]
    assert p.locator("[data-chart=model] text.name").all_text_contents() == ["smol", "tiny"]
    shot(p, "30-usage-admin")

    with p.expect_download() as info:
        p.click("a[data-action=csv]")
    download = info.value
    assert download.suggested_filename.startswith("modelyard-usage-")
    text = Path(download.path()).read_text()
    table = {(r["owner"], r["model"]): int(r["requests"])
             for r in csv.DictReader(io.StringIO(text))}
    assert table == {("ana", "smol"): 3, ("ana", "tiny"): 1, ("ben", "smol"): 3, ("ben", "tiny"): 2}

    # One user's view: the owner filter.
    p.fill("input[name=owner]", "ana")
    p.press("input[name=owner]", "Enter")
    p.wait_for_function("() => document.querySelectorAll('tr[data-owner]').length === 2")
    p.select_option("select[name=period]", "7d")
    p.wait_for_selector("[data-chart=time]")
    shot(p, "31-usage-one-owner-7d")


def test_a_user_sees_only_their_own_usage(server: Server, page: tuple[Page, Console]) -> None:
    p, _ = page
    login(p, server.url, "ben", USERS["ben"][0])
    p.wait_for_selector("nav a[data-page=usage]")
    p.goto(server.url + "/#/usage")
    p.wait_for_selector(".page[data-page=usage] table")
    assert {p.locator("tr[data-owner]").nth(i).get_attribute("data-owner")
            for i in range(p.locator("tr[data-owner]").count())} == {"ben"}
    assert p.locator("input[name=owner]").count() == 0  # no owner filter for a user
    assert p.locator("[data-chart=user]").count() == 0
    shot(p, "32-usage-user")
