"""Every route of the app, called without credentials: only the documented public ones answer.

The routes are enumerated from the app itself (`create_app(...).routes`), so a route added later
without thinking about auth fails here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from starlette.routing import Mount, Route
from tests.integration.harness import config
from tests.support import Server, fake_model

from modelyard.config import Settings
from modelyard.front.app import create_app
from modelyard.front.identity.auth import RouteClass, route_class

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# The documented public routes (docs/security.md): health, the login page and what it loads.
PUBLIC = {("GET", "/health"), ("GET", "/"), ("GET", "/login"), ("POST", "/auth/login")}
PUBLIC.add(("GET", "/openapi.json"))  # the API's description: clients read it before a token
PUBLIC_PREFIX = "/studio/assets/"


def every_route() -> list[tuple[str, str]]:
    """(method, concrete path) for each route and method of the front app."""
    app = create_app(Settings(scan_hf_cache=False, devices="cpu"))
    found: list[tuple[str, str]] = []
    for route in app.routes:
        if isinstance(route, Route):
            path = re.sub(r"\{[^}]+\}", "x", route.path)
            found += [(m, path) for m in sorted(route.methods or ()) if m != "HEAD"]
        elif isinstance(route, Mount):
            found.append(("GET", route.path + "/studio.css"))
    return found


ROUTES = every_route()


def is_public(method: str, path: str) -> bool:
    return (method, path) in PUBLIC or (method == "GET" and path.startswith(PUBLIC_PREFIX))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    started = {
        mode: Server(tmp_path_factory.mktemp(mode), config(fake_model("m1"), auth=mode),
                     "--single-process")
        for mode in ("required", "auto")
    }
    try:
        for server in started.values():
            server.wait_healthy()
        yield started
    finally:
        for server in started.values():
            server.stop()


def call(server: Server, method: str, path: str) -> httpx.Response:
    return httpx.request(method, server.url + path, json={}, timeout=30)


def test_the_enumeration_sees_the_whole_app() -> None:
    paths = {p for _, p in ROUTES}
    assert len(ROUTES) > 40
    for expected in ("/v1/chat/completions", "/api/chat", "/admin/engines", "/pull",
                     "/tokens", "/admin/users", "/auth/login", "/health"):
        assert expected in paths, expected


def test_with_auth_required_only_the_public_routes_answer(servers: dict[str, Server]) -> None:
    server = servers["required"]
    answered = set()
    for method, path in ROUTES:
        r = call(server, method, path)
        if r.status_code != 401:
            answered.add((method, path))
            assert is_public(method, path), (method, path, r.status_code, r.text[:200])
    assert {("GET", "/health"), ("POST", "/auth/login")} <= answered


def test_with_auth_auto_on_loopback_only_public_and_inference_routes_answer(
    servers: dict[str, Server],
) -> None:
    server = servers["auto"]
    for method, path in ROUTES:
        r = call(server, method, path)
        cls = route_class(method, path)
        if cls in (RouteClass.PUBLIC, RouteClass.INFERENCE):
            assert r.status_code != 401, (method, path, r.text[:200])
        else:
            assert r.status_code == 401, (method, path, r.status_code, r.text[:200])


def test_public_routes_are_exactly_the_documented_ones() -> None:
    public = {(m, p) for m, p in ROUTES if route_class(m, p) is RouteClass.PUBLIC}
    assert public == {(m, p) for m, p in ROUTES if is_public(m, p)}
    assert {(m, p) for m, p in public if not p.startswith(PUBLIC_PREFIX)} <= PUBLIC
