"""The Web Studio's routes on a real `modelyard serve`: the shell page, its assets (right media
types, nothing outside the studio folder), and the live feed the dashboard draws."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.integration.harness import config, module_server
from tests.support import Server, fake_model

from modelyard.front.api import studio

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

EXPECTED_TYPES = {".html": "text/html", ".css": "text/css", ".js": "text/javascript",
                  ".svg": "image/svg+xml"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with module_server(tmp_path_factory, config(fake_model("studio-m"))) as srv:
        yield srv


def test_the_shell_is_served_at_the_root_and_at_login_without_auth(server: Server) -> None:
    for path in ("/", "/login"):  # as a browser asks (others get "Ollama is running" at /)
        r = httpx.get(server.url + path, headers={"Accept": "text/html"}, timeout=10)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/html")
        assert r.headers["cache-control"] == "no-cache"
        assert '<div id="app"' in r.text
        assert 'src="/studio/assets/js/main.js"' in r.text


def test_every_asset_is_served_with_its_media_type(server: Server) -> None:
    files = sorted(f for f in studio.STUDIO_DIR.rglob("*") if f.is_file())
    assert {f.suffix for f in files} <= set(EXPECTED_TYPES), "an asset of an unlisted type"
    assert len([f for f in files if f.suffix == ".js"]) >= 5
    for f in files:
        relative = f.relative_to(studio.STUDIO_DIR).as_posix()
        r = httpx.get(f"{server.url}/studio/assets/{relative}", timeout=10)
        assert r.status_code == 200, (relative, r.text)
        assert r.headers["content-type"].startswith(EXPECTED_TYPES[f.suffix]), relative
        assert r.content == f.read_bytes()


@pytest.mark.parametrize("path", [
    "/studio/assets/%2e%2e/app.py",
    "/studio/assets/%2e%2e/%2e%2e/front/api/studio.py",
    "/studio/assets/..%2f..%2f..%2fpyproject.toml",
    "/studio/assets/%2e%2e/%2e%2e/%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
    "/studio/assets/js",
    "/studio/assets/no-such-file.js",
    "/studio/assets/",
    "/studio/assets/" + "x" * 300 + ".js",  # a name the file system refuses (ENAMETOOLONG)
])
def test_paths_outside_the_assets_are_404(server: Server, path: str) -> None:
    r = httpx.get(server.url + path, timeout=10)
    assert r.status_code == 404, r.text
    assert r.json()["error"] == "not_found"


def test_the_resolver_refuses_files_and_links_that_leave_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "studio"
    (root / "js").mkdir(parents=True)
    (root / "js" / "ok.js").write_text("export {};")
    (tmp_path / "secret.json").write_text("{}")
    (root / "js" / "link.js").symlink_to(tmp_path / "secret.json")
    monkeypatch.setattr(studio, "STUDIO_DIR", root)
    assert studio.asset_path("js/ok.js") == (root / "js" / "ok.js").resolve()
    assert studio.asset_path("../secret.json") is None
    assert studio.asset_path("js/../../secret.json") is None
    assert studio.asset_path(str(tmp_path / "secret.json")) is None  # absolute
    assert studio.asset_path("js/link.js") is None
    assert studio.asset_path("js") is None


def _first_status_event(server: Server, headers: dict[str, str]) -> dict[str, object]:
    with httpx.stream("GET", server.url + "/studio/events", headers=headers, timeout=15) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        event, data = None, None
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "status":
                data = json.loads(line[5:])
                break
    assert data is not None
    return dict(data)


def test_studio_events_need_a_login(server: Server) -> None:
    r = httpx.get(server.url + "/studio/events", timeout=10)
    assert r.status_code == 401, r.text
    assert r.json()["error"] == "unauthorized"


def test_studio_events_send_the_status_and_the_pulls(server: Server) -> None:
    event = _first_status_event(server, server.admin_headers)
    status = event["status"]
    assert isinstance(status, dict)
    direct = httpx.get(server.url + "/status", headers=server.admin_headers, timeout=10).json()
    assert set(status) == set(direct)
    assert [e["name"] for e in status["engines"]] == [e["name"] for e in direct["engines"]]
    assert status["engines"][0]["up"] is True
    assert event["jobs"] == []


def test_studio_events_follow_a_change_and_stop_when_the_client_leaves(server: Server) -> None:
    """A model loaded while the feed is open shows in a later event; after the client closed
    several feeds the server still answers at once (no stuck streams)."""
    headers = server.admin_headers
    r = httpx.post(server.url + "/admin/models/studio-m/load", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    with httpx.stream("GET", server.url + "/studio/events", headers=headers, timeout=15) as s:
        for line in s.iter_lines():
            if line.startswith("data:"):
                engines = json.loads(line[5:])["status"]["engines"]
                states = {m["model"]: m["state"] for e in engines for m in e["models"]}
                if states.get("studio-m") == "ready":
                    break
    for _ in range(5):
        _first_status_event(server, headers)
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
