"""End to end: the Web Studio in a real browser (Debian's headless chromium driven by
Playwright) against a real modelyard, the real llama-server and the real demo model, which a pull
fetches from the local fake Hub (tests/fakes/fake_hub.py) slowly enough to watch its progress.

    first login → forced password change → dashboard shows the engine → pull with a moving
    progress bar → chat with streamed tokens (and Stop) → unload → archive entry seen, then
    deleted → the pulled model deleted

and a tour from the dashboard to every page. Each page is saved as a screenshot under
$MODELYARD_ARTIFACTS/studio (default: test-artifacts/studio/ in the repository).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Playwright, sync_playwright
from tests.fakes.hub_repos import HubServer, gguf_repo
from tests.integration.pull_support import hub_env, start_server
from tests.support import ROOT, Server, poll, require_e2e_artifact

from modelyard.config import DEMO_MODEL_FILE, Settings, cache_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
FIRST_PASSWORD = "first-boot-one-time"
NEW_PASSWORD = "a-password-of-my-own"
REPO = "org/smol-GGUF"
MODEL = "org/smol-gguf:q4_1"  # what the pull of org/smol-GGUF:Q4_1 is called
# The demo GGUF is ~98 MB: at this rate the pull takes ~6 s, several 1 s updates of the bar.
HUB_BYTES_PER_S = 16_000_000
UI_TIMEOUT_MS = 120_000  # a cold load of llama-server on a busy 2-core machine


def artifacts() -> Path:
    base = os.environ.get("MODELYARD_ARTIFACTS")
    where = Path(base) / "studio" if base else ROOT / "test-artifacts" / "studio"
    where.mkdir(parents=True, exist_ok=True)
    return where


def shot(page: Page, name: str) -> None:
    page.screenshot(path=str(artifacts() / f"{name}.png"), full_page=True)


def demo_gguf() -> Path:
    for where in (cache_dir() / "models", Path.home() / ".modelyard" / "models"):
        if (where / DEMO_MODEL_FILE).is_file():
            return where / DEMO_MODEL_FILE
    return require_e2e_artifact(None, "the demo model")


# ---- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    require_e2e_artifact(CHROMIUM if CHROMIUM.exists() else None, "Debian's chromium")
    require_e2e_artifact(Settings().resolve_llama_server(), "llama-server")
    root = tmp_path_factory.mktemp("studio-hub") / "repos"
    gguf_repo(root, REPO, demo_gguf(), quants=("Q4_1",))
    with HubServer(root, bytes_per_s=HUB_BYTES_PER_S) as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, hub: HubServer) -> Iterator[Server]:
    base = tmp_path_factory.mktemp("studio")
    cfg = {"scan_hf_cache": False, "default_ctx_size": 2048, "models": []}
    env = {**hub_env(hub, base / "hf"), "MODELYARD_ADMIN_PASSWORD": FIRST_PASSWORD}
    srv = start_server(base / "home", cfg, env, "--simulate-gpus", "1x8GiB",
                       healthy_timeout_s=90)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright: Playwright, hub: HubServer) -> Iterator[Browser]:
    b = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
    try:
        yield b
    finally:
        b.close()


class Console:
    """Uncaught page errors: a Studio page must raise none."""

    def __init__(self, page: Page) -> None:
        self.errors: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        page.on("console", self._console)

    def _console(self, message: ConsoleMessage) -> None:
        # A failed request logs a console error too; those the Studio shows in place.
        if message.type == "error" and "Failed to load resource" not in message.text:
            self.errors.append(message.text)


@pytest.fixture
def page(browser: Browser) -> Iterator[tuple[Page, Console]]:
    context = browser.new_context(viewport={"width": 1400, "height": 900},
                                  color_scheme="dark", accept_downloads=True)
    context.set_default_timeout(30_000)
    p = context.new_page()
    console = Console(p)
    try:
        yield p, console
    finally:
        context.close()
    assert console.errors == [], console.errors


def api(server: Server, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """The server's API as the CLI's admin token."""
    return httpx.request(method, server.url + path, headers=server.admin_headers, timeout=30,
                         **kwargs)


def login(page: Page, url: str, user: str, password: str) -> None:
    page.goto(url + "/")
    page.fill("input[name=username]", user)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")


# ---- the journey ----------------------------------------------------------------------------


def test_first_login_pull_chat_unload_archive(server: Server,
                                              page: tuple[Page, Console]) -> None:
    p, _ = page
    first_login_and_password_change(p, server)
    dashboard_shows_the_engine(p)
    pull_with_a_moving_progress_bar(p, server)
    chat_streams_tokens_and_stops(p, server)
    unload(p, server)
    archive_entry_seen_then_deleted(p, server)
    delete_the_pulled_model(p, server)


def first_login_and_password_change(p: Page, server: Server) -> None:
    p.goto(server.url + "/login")
    p.wait_for_selector("input[name=username]")
    shot(p, "01-login")
    login(p, server.url, "admin", "not-the-password")
    error = p.locator(".alert.error")
    error.wait_for()
    assert "wrong user name or password" in error.inner_text()
    shot(p, "02-login-error")

    p.fill("input[name=password]", FIRST_PASSWORD)
    p.click("button[type=submit]")
    p.wait_for_selector("input[name=new_password]")
    assert p.locator("nav").count() == 0, "no way around the forced change"
    shot(p, "03-forced-password-change")
    p.fill("input[name=current_password]", FIRST_PASSWORD)
    p.fill("input[name=new_password]", NEW_PASSWORD)
    p.fill("input[name=confirm_password]", NEW_PASSWORD)
    p.click("button[type=submit]")
    p.wait_for_selector(".engine-card")
    assert p.url.endswith("/#/dashboard")
    # The one-time password no longer works; the new one does.
    assert httpx.post(server.url + "/auth/login", json={
        "username": "admin", "password": FIRST_PASSWORD}, timeout=10).status_code == 401
    me = httpx.post(server.url + "/auth/login", json={
        "username": "admin", "password": NEW_PASSWORD}, timeout=10).json()
    assert me["user"]["must_change_password"] is False


def dashboard_shows_the_engine(p: Page) -> None:
    card = p.locator(".engine-card[data-engine='engine-0']")
    card.wait_for()
    assert "up" in card.locator(".badge").first.inner_text()
    assert "8.0 GiB" in card.inner_text()  # the simulated device's memory bar
    assert card.locator("[role=meter]").count() == 1
    p.wait_for_selector(".live-pill.on")
    shot(p, "04-dashboard")


# Every value the pull's progress bar takes, recorded in the page as it changes.
RECORD_PROGRESS = """() => {
  window.__progress = [];
  new MutationObserver((changes) => {
    for (const c of changes) {
      const bar = c.target;
      if (bar.matches && bar.matches('.job .progress') && bar.hasAttribute('aria-valuenow')) {
        window.__progress.push(Number(bar.getAttribute('aria-valuenow')));
      }
    }
  }).observe(document.body, {subtree: true, attributes: true, attributeFilter: ['aria-valuenow']});
}"""


def pull_with_a_moving_progress_bar(p: Page, server: Server) -> None:
    p.click("nav a[data-page=models]")
    p.wait_for_selector("form.card input[name=model]")
    p.evaluate(RECORD_PROGRESS)
    p.fill("input[name=model]", f"{REPO}:Q4_1")
    p.click("form.card button[type=submit]")
    job = p.locator(".job")
    job.wait_for()
    p.wait_for_function(
        "() => window.__progress.some((v) => v > 5 && v < 95)", timeout=60_000)
    shot(p, "05-pull-progress")
    p.wait_for_selector(".job[data-status=succeeded]", timeout=120_000)
    seen = p.evaluate("window.__progress")
    middle = sorted({v for v in seen if 0 < v < 100})
    assert middle, f"the bar went from empty to full with nothing between: {seen}"
    assert p.locator(".job .progress").get_attribute("aria-valuenow") == "100.0"
    row = p.locator(f"tr[data-model='{MODEL}']")
    row.wait_for()
    assert "pulled" in row.inner_text()
    shot(p, "06-models-pulled")
    jobs = api(server, "GET", "/jobs").json()["jobs"]
    assert [(j["model_id"], j["status"]) for j in jobs] == [(MODEL, "succeeded")]


# What the last answer looks like at each change while it streams: its text's length, whether
# it is still marked streaming, and whether the Stop button shows. Recorded by an observer, as a
# short answer streams faster than a test can poll the page.
RECORD_STREAM = """() => {
  window.__seen = [];
  new MutationObserver(() => {
    const bubbles = document.querySelectorAll('.msg.assistant .bubble');
    const last = bubbles[bubbles.length - 1];
    if (!last) return;
    const stop = document.querySelector('button[data-action=stop]');
    window.__seen.push({n: last.textContent.length,
                        streaming: last.closest('.msg').classList.contains('streaming'),
                        stop: stop !== null && !stop.hidden});
  }).observe(document.querySelector('.transcript'),
             {subtree: true, childList: true, characterData: true, attributes: true});
}"""


def chat_streams_tokens_and_stops(p: Page, server: Server) -> None:
    p.click(f"tr[data-model='{MODEL}'] button:has-text('Chat')")
    p.wait_for_selector(".chat")
    p.wait_for_function(
        f"() => document.querySelector('select[name=model]').value === '{MODEL}'")
    p.select_option("select[name=archive]", "1h")
    p.fill("input[name=temperature]", "0")
    p.dispatch_event("input[name=temperature]", "change")
    p.fill("input[name=max_tokens]", "24")
    p.dispatch_event("input[name=max_tokens]", "change")
    p.evaluate(RECORD_STREAM)
    p.fill("textarea[name=prompt]", "Name three colours of the rainbow.")
    p.keyboard.press("Enter")
    p.wait_for_selector(".msg.assistant:not(.streaming) .msg-meta:not(:empty)",
                        timeout=UI_TIMEOUT_MS)
    seen = p.evaluate("window.__seen")
    lengths = [s["n"] for s in seen if s["n"] > 0]
    assert len(set(lengths)) >= 3, f"the answer did not arrive piece by piece: {lengths}"
    streaming = [s for s in seen if s["n"] > 0 and s["streaming"]]
    assert streaming, f"the answer was never shown while streaming: {seen}"
    assert all(s["stop"] for s in streaming), f"no Stop button while it streamed: {seen}"
    answer = p.locator(".msg.assistant .bubble").last.inner_text()
    assert answer.strip()
    assert "tokens" in p.locator(".msg.assistant .msg-meta").last.inner_text()
    shot(p, "08-chat-answered")

    # Stop: a long answer is cut off by the button, and modelyard stops generating it.
    p.fill("input[name=max_tokens]", "2000")
    p.dispatch_event("input[name=max_tokens]", "change")
    p.fill("textarea[name=prompt]", "Write a very long story about a lighthouse.")
    p.click("button[data-action=send]")
    p.wait_for_selector(".msg.assistant.streaming .bubble:not(:empty)", timeout=UI_TIMEOUT_MS)
    shot(p, "07-chat-streaming")
    p.click("button[data-action=stop]")
    meta = p.locator(".msg.assistant .msg-meta").last
    meta.wait_for()
    p.wait_for_function("() => [...document.querySelectorAll('.msg-meta')].pop()"
                        ".textContent.includes('stopped')")
    assert p.locator("button[data-action=send]").is_visible()
    poll(lambda: api(server, "GET", "/status").json()["queues"][MODEL]["running"] == 0,
         timeout_s=30, what="the stopped request to end on the server")
    shot(p, "09-chat-stopped")

    p.click("nav a[data-page=dashboard]")
    p.wait_for_selector(f".engine-model[data-model='{MODEL}']")
    shot(p, "10-dashboard-model-loaded")


def unload(p: Page, server: Server) -> None:
    p.click("nav a[data-page=models]")
    row = p.locator(f"tr[data-model='{MODEL}']")
    row.locator("button[data-action=unload]").click()
    row.locator("button[data-action=load]").wait_for(timeout=60_000)
    assert "ready" not in row.inner_text()
    loaded = [m["model"] for m in api(server, "GET", "/models").json()["models"] if m["loaded"]]
    assert MODEL not in loaded
    shot(p, "11-models-unloaded")


def archive_entry_seen_then_deleted(p: Page, server: Server) -> None:
    # The transcript is saved just after the answer ends: wait for it, then look.
    poll(lambda: any(i["model"] == MODEL for i in api(server, "GET", "/archive").json()["items"]),
         timeout_s=30, what="the chat transcript in the archive")
    p.click("nav a[data-page=archive]")
    rows = p.locator("tr[data-item]")
    rows.first.wait_for()
    first = rows.first
    assert MODEL in first.inner_text() and "chat" in first.inner_text()
    first.locator("button[data-action=view]").click()
    preview = p.locator("pre.preview")
    preview.wait_for()
    assert "Name three colours of the rainbow." in preview.inner_text() or \
        "lighthouse" in preview.inner_text()
    with p.expect_download() as download:
        first.locator("a[data-action=download]").click()
    assert download.value.suggested_filename.endswith(".json")
    shot(p, "12-archive")

    while rows.count():
        before = rows.count()
        rows.first.locator("button[data-action=delete]").click()
        p.locator("dialog button[value=ok]").click()
        p.wait_for_function(f"() => document.querySelectorAll('tr[data-item]').length < {before}")
    p.get_by_text("The archive is empty").wait_for()
    assert api(server, "GET", "/archive").json()["items"] == []
    shot(p, "13-archive-emptied")


def delete_the_pulled_model(p: Page, server: Server) -> None:
    p.click("nav a[data-page=models]")
    row = p.locator(f"tr[data-model='{MODEL}']")
    row.locator("button[data-action=delete]").click()
    p.locator("dialog button[value=ok]").click()
    row.wait_for(state="detached", timeout=60_000)
    assert MODEL not in [m["model"] for m in api(server, "GET", "/models").json()["models"]]
    shot(p, "14-models-after-delete")


# ---- every page from the dashboard ------------------------------------------------------------

PAGES = {"models": "Models", "chat": "Chat", "logs": "Logs", "archive": "Archive",
         "usage": "Usage", "admin": "Users & tokens"}


def tour_user(server: Server) -> tuple[str, str]:
    """An admin with a password of their own, so this test does not depend on the first."""
    name, password = "tour", "tour-password-1"
    r = api(server, "POST", "/admin/users", json={
        "name": name, "password": password, "is_admin": True, "must_change_password": False})
    assert r.status_code in (201, 409), r.text
    return name, password


def test_every_page_is_reachable_from_the_dashboard(server: Server,
                                                    page: tuple[Page, Console]) -> None:
    p, _ = page
    login(p, server.url, *tour_user(server))
    p.wait_for_selector(".engine-card")
    for name, title in PAGES.items():
        # From the dashboard's own tiles, then back through the navigation.
        p.click(f"a.link-tile[data-link={name}]")
        p.wait_for_selector(f".page[data-page={name}] h1")
        assert p.locator("h1").inner_text() == title
        assert p.locator(f"nav a[data-page={name}]").get_attribute("aria-current") == "page"
        settle(p, name)
        shot(p, f"20-page-{name}")
        p.click("nav a[data-page=dashboard]")
        p.wait_for_selector(".engine-card")

    # The light theme, remembered across a reload.
    p.click("button[aria-label='Toggle theme']")
    p.reload()
    p.wait_for_selector(".engine-card")
    assert p.evaluate("document.documentElement.dataset.theme") == "light"
    shot(p, "21-dashboard-light")


def settle(p: Page, name: str) -> None:
    """Waits for what the page loads, so its screenshot shows it."""
    if name == "models":
        p.wait_for_selector("table, .empty")
    elif name == "chat":
        p.wait_for_function("() => !document.querySelector('select[name=model]')"
                            ".textContent.includes('Loading')")
    elif name == "logs":
        p.wait_for_selector(".log-line")  # the front's log: it said its engine was ready
        p.select_option("select[name=source]", "engine:engine-0")
        p.wait_for_selector(".live-pill.on")
        p.wait_for_selector(".log-line, .logs-view .empty")
    elif name in ("archive", "usage"):
        p.wait_for_selector("table, .empty")
    elif name == "admin":
        p.wait_for_selector("tr[data-user=tour]")
        p.fill("input[name=token_name]", "tour-laptop")
        p.click("button:has-text('Create token')")
        secret = p.locator("[data-secret=token]")
        secret.wait_for()
        assert secret.inner_text().startswith("my-")
        p.wait_for_selector("tr[data-token] >> text=tour-laptop")


def test_errors_show_in_place(server: Server, page: tuple[Page, Console]) -> None:
    p, _ = page
    login(p, server.url, *tour_user(server))
    p.wait_for_selector(".engine-card")
    p.click("nav a[data-page=models]")
    p.fill("input[name=model]", "org/no-such-repo-GGUF:Q4_0")
    p.click("form.card button[type=submit]")
    failed = p.locator(".job[data-status=failed]")
    failed.wait_for(timeout=60_000)
    assert "no repository org/no-such-repo-GGUF" in failed.locator(".alert.error").inner_text()
    p.fill("input[name=model]", "not a reference")
    p.click("form.card button[type=submit]")
    error = p.locator("form.card .alert.error")
    error.wait_for()
    assert error.inner_text().strip()
    shot(p, "30-models-errors")
