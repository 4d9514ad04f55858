"""The gate's pure parts: route classes, Host names, and the decision table per auth mode."""

from __future__ import annotations

import pytest

from modelyard.config import Settings
from modelyard.errors import (
    CsrfFailed,
    Forbidden,
    ModelyardError,
    PasswordChangeRequired,
    Unauthorized,
)
from modelyard.front.identity.accounts import LoginSession, User
from modelyard.front.identity.auth import (
    Identified,
    RequestHeaders,
    RouteClass,
    allowed_host_names,
    check_bind,
    check_browser_request,
    decide,
    host_name,
    login_principal,
    origin_allowed,
    route_class,
    token_principal,
)
from modelyard.front.identity.tokens import Token

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

ALICE = User("alice", False, False, None, 0.0)
ROOT = User("root", True, False, None, 0.0)


def token(scopes: tuple[str, ...], owner_is_admin: bool = True) -> Identified:
    t = Token("t1", "ci", "root", owner_is_admin, "my-abc", scopes, None, 0.0, None, None)
    return Identified(token_principal(t))


def login(user: User, csrf: str = "c" * 43) -> Identified:
    return Identified(login_principal(user), LoginSession("s1", user, csrf, 1e12))


@pytest.mark.parametrize(("method", "path", "cls"), [
    ("GET", "/health", RouteClass.PUBLIC),
    ("HEAD", "/health", RouteClass.PUBLIC),
    ("GET", "/", RouteClass.PUBLIC),
    ("POST", "/auth/login", RouteClass.PUBLIC),
    ("GET", "/openapi.json", RouteClass.PUBLIC),
    ("GET", "/studio/assets/studio.css", RouteClass.PUBLIC),
    ("POST", "/studio/assets/x", RouteClass.ADMIN),
    ("POST", "/v1/chat/completions", RouteClass.INFERENCE),
    ("GET", "/v1/models", RouteClass.INFERENCE),
    ("POST", "/api/chat", RouteClass.INFERENCE),
    ("GET", "/api/tags", RouteClass.INFERENCE),
    ("POST", "/api/pull", RouteClass.ADMIN),
    ("DELETE", "/api/delete", RouteClass.ADMIN),
    ("POST", "/chat", RouteClass.INFERENCE),
    ("GET", "/models", RouteClass.INFERENCE),
    ("DELETE", "/models/m1", RouteClass.ADMIN),
    ("GET", "/status", RouteClass.INFERENCE),
    ("GET", "/auth/me", RouteClass.USER),
    ("POST", "/tokens", RouteClass.ACCOUNT),
    ("GET", "/tokens", RouteClass.ACCOUNT),
    ("DELETE", "/tokens/abc", RouteClass.ACCOUNT),
    ("POST", "/auth/password", RouteClass.ACCOUNT),
    ("PATCH", "/auth/me", RouteClass.ACCOUNT),  # the account's settings (issue 31 §9)
    ("POST", "/auth/logout", RouteClass.USER),
    ("GET", "/archive/abc/content", RouteClass.USER),
    ("GET", "/studio/events", RouteClass.USER),
    ("GET", "/activity", RouteClass.USER),  # admins see every request, users their own
    ("GET", "/activity/stream", RouteClass.USER),
    ("GET", "/admin/engines", RouteClass.ADMIN),
    ("POST", "/pull", RouteClass.ADMIN),
    ("GET", "/jobs", RouteClass.ADMIN),
    ("GET", "/anything-new", RouteClass.ADMIN),
])
def test_route_classes(method: str, path: str, cls: RouteClass) -> None:
    assert route_class(method, path) is cls


def outcome(settings: Settings, method: str, path: str, who: Identified | None,
            bad_token: bool = False, csrf: str | None = None) -> str:
    try:
        principal = decide(settings, route_class(method, path), method, path, who, bad_token,
                           csrf)
    except ModelyardError as exc:
        return exc.code
    return f"{principal.via}:{principal.user}:{'admin' if principal.is_admin else 'user'}"


LOOPBACK = Settings(host="127.0.0.1")
PUBLIC_BIND = Settings(host="0.0.0.0")
REQUIRED = Settings(host="127.0.0.1", auth="required")
NONE = Settings(host="127.0.0.1", auth="none")


@pytest.mark.parametrize(("settings", "method", "path", "who", "expected"), [
    # auto on loopback: inference is open, the rest needs someone
    (LOOPBACK, "POST", "/v1/chat/completions", None, "anonymous:None:user"),
    (LOOPBACK, "GET", "/admin/engines", None, "unauthorized"),
    (LOOPBACK, "GET", "/archive", None, "unauthorized"),
    (LOOPBACK, "GET", "/health", None, "anonymous:None:user"),
    (LOOPBACK, "GET", "/admin/engines", login(ALICE), "forbidden"),
    (LOOPBACK, "GET", "/admin/engines", login(ROOT), "session:root:admin"),
    (LOOPBACK, "GET", "/admin/engines", token(("inference",)), "forbidden"),
    (LOOPBACK, "GET", "/admin/engines", token(("inference", "admin")), "token:root:admin"),
    # an admin scope counts only while its owner is an admin
    (LOOPBACK, "GET", "/admin/engines", token(("inference", "admin"), False), "forbidden"),
    (LOOPBACK, "POST", "/v1/chat/completions", token(("admin",)), "forbidden"),
    # auto on a public address: everything but the public routes needs auth
    (PUBLIC_BIND, "POST", "/v1/chat/completions", None, "unauthorized"),
    (PUBLIC_BIND, "GET", "/status", None, "unauthorized"),
    (PUBLIC_BIND, "GET", "/health", None, "anonymous:None:user"),
    (PUBLIC_BIND, "POST", "/v1/chat/completions", token(("inference",)), "token:root:user"),
    (REQUIRED, "GET", "/v1/models", None, "unauthorized"),
    (REQUIRED, "POST", "/auth/login", None, "anonymous:None:user"),
    # none: open, and whoever logs in anyway acts as an admin
    (NONE, "GET", "/admin/engines", None, "anonymous:None:admin"),
    (NONE, "GET", "/admin/engines", login(ALICE), "session:alice:admin"),
])
def test_decisions(settings: Settings, method: str, path: str, who: Identified | None,
                   expected: str) -> None:
    assert outcome(settings, method, path, who) == expected


def test_a_bad_modelyard_token_is_refused_even_where_anonymous_callers_are_let_in() -> None:
    """Issue 31 §9: a revoked or made-up `my-…` token made its caller anonymous on an open
    loopback server, out of the limits of the token's user. (Other keys name nobody: `identify`
    does not call them bad, and they are ignored like no key.)"""
    for settings in (LOOPBACK, REQUIRED, NONE):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                             ("GET", "/admin/engines"), ("GET", "/status")):
            assert outcome(settings, method, path, None, bad_token=True) == "unauthorized"
    # The public routes stay public (a health probe, the login page, the login itself).
    assert outcome(LOOPBACK, "GET", "/health", None, bad_token=True) == "anonymous:None:user"
    assert outcome(REQUIRED, "POST", "/auth/login", None, bad_token=True) == \
        "anonymous:None:user"


def test_sessions_need_csrf_on_unsafe_methods_and_a_changed_password() -> None:
    csrf = "c" * 43
    assert outcome(LOOPBACK, "POST", "/tokens", login(ROOT)) == CsrfFailed.code
    assert outcome(LOOPBACK, "POST", "/tokens", login(ROOT), csrf="wrong") == CsrfFailed.code
    assert outcome(LOOPBACK, "POST", "/tokens", login(ROOT), csrf=csrf) == "session:root:admin"
    assert outcome(LOOPBACK, "GET", "/tokens", login(ROOT)) == "session:root:admin"
    fresh = User("root", True, True, None, 0.0)
    assert outcome(LOOPBACK, "GET", "/status", login(fresh)) == PasswordChangeRequired.code
    assert outcome(LOOPBACK, "POST", "/auth/password", login(fresh),
                   csrf=csrf) == "session:root:admin"
    assert outcome(LOOPBACK, "GET", "/auth/me", login(fresh)) == "session:root:admin"
    # Tokens never need CSRF: a cross-site page cannot read or send them.
    assert outcome(LOOPBACK, "POST", "/tokens", token(("inference", "admin"))) == \
        "token:root:admin"
    assert issubclass(PasswordChangeRequired, Forbidden) and Unauthorized.status == 401


@pytest.mark.parametrize(("header", "name"), [
    ("localhost:8770", "localhost"), ("LOCALHOST", "localhost"), ("[::1]:8770", "::1"),
    ("127.0.0.1", "127.0.0.1"), ("my.box:80", "my.box"), ("", ""),
])
def test_host_names(header: str, name: str) -> None:
    assert host_name(header) == name


def test_allowed_hosts_per_bind() -> None:
    assert allowed_host_names(LOOPBACK) == {"localhost", "127.0.0.1", "::1"}
    assert allowed_host_names(Settings(host="0.0.0.0")) is None
    assert allowed_host_names(Settings(host="0.0.0.0", allowed_hosts=["My.Box"])) == {
        "my.box", "localhost", "127.0.0.1", "::1"}
    assert allowed_host_names(Settings(host="10.1.2.3")) == {"10.1.2.3"}


def test_none_is_refused_off_loopback_with_the_fix_in_the_message() -> None:
    check_bind(NONE)
    check_bind(Settings(host="::1", auth="none"))
    with pytest.raises(ValueError, match=r"only on a loopback address.*127\.0\.0\.1"):
        check_bind(Settings(host="0.0.0.0", auth="none"))


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/tokens"), ("GET", "/tokens"), ("DELETE", "/tokens/t0"),
    ("POST", "/auth/password"), ("PATCH", "/auth/me"),
])
def test_an_inference_token_cannot_manage_its_account(method: str, path: str) -> None:
    """Issue 15 §2: a leaked inference token must not mint tokens, revoke others or change the
    password; a login session or an admin token may."""
    csrf = "c" * 43
    assert outcome(LOOPBACK, method, path, token(("inference",))) == Forbidden.code
    assert outcome(REQUIRED, method, path, token(("inference",))) == Forbidden.code
    assert outcome(LOOPBACK, method, path, token(("inference", "admin"))) == "token:root:admin"
    assert outcome(LOOPBACK, method, path, login(ALICE), csrf=csrf) == "session:alice:user"
    assert outcome(LOOPBACK, method, path, None) == Unauthorized.code


@pytest.mark.parametrize(("origin", "host", "allowed"), [
    ("http://127.0.0.1:8770", "127.0.0.1:8770", True),
    ("http://LOCALHOST:8770", "localhost:8770", True),
    ("https://box.example", "box.example:443", True),  # default ports are dropped
    ("http://127.0.0.1:8771", "127.0.0.1:8770", False),  # another local server
    ("http://evil.example", "127.0.0.1:8770", False),
    ("null", "127.0.0.1:8770", False),
    ("file://", "127.0.0.1:8770", False),
    ("http://app.example", "127.0.0.1:8770", True),  # cors_origins
    ("https://proxy.example", "127.0.0.1:8770", True),  # allowed_hosts (a rewriting proxy)
])
def test_origins(origin: str, host: str, allowed: bool) -> None:
    settings = Settings(host="127.0.0.1", cors_origins=["http://app.example/"],
                        allowed_hosts=["proxy.example"])
    assert origin_allowed(settings, origin, host) is allowed
    assert origin_allowed(Settings(host="127.0.0.1", cors_origins=["*"]), origin, host)


def browser(method: str, path: str, who: Identified | None, **headers: str) -> str:
    try:
        check_browser_request(LOOPBACK, method, path,
                              RequestHeaders([(k.encode(), v.encode()) for k, v in
                                              {"host": "127.0.0.1:8770", **headers}.items()]),
                              who)
    except ModelyardError as exc:
        return exc.code
    return "ok"


def test_cross_site_requests_are_refused_where_the_browser_carries_the_authority() -> None:
    """Issue 15 §11: the login and cookie routes refuse text/plain and foreign origins."""
    evil = {"origin": "http://evil.example"}
    text = {"content-type": "text/plain", "content-length": "10"}
    json_body = {"content-type": "application/json; charset=utf-8", "content-length": "10"}
    assert browser("POST", "/auth/login", None, **text) == "unsupported_media_type"
    assert browser("POST", "/auth/login", None, **json_body) == "ok"
    assert browser("POST", "/auth/login", None, **json_body, **evil) == "origin_not_allowed"
    cookie = login(ROOT)
    assert browser("POST", "/tokens", cookie, **text) == "unsupported_media_type"
    assert browser("POST", "/tokens", cookie, **json_body, **evil) == "origin_not_allowed"
    assert browser("POST", "/auth/logout", cookie) == "ok"  # no body, no type needed
    assert browser("GET", "/tokens", cookie, **evil) == "ok"  # reads change nothing
    # Anonymous (open loopback): a foreign page is refused, curl's form type is not.
    assert browser("POST", "/v1/chat/completions", None, **evil) == "origin_not_allowed"
    assert browser("POST", "/api/generate", None, **{
        "content-type": "application/x-www-form-urlencoded", "content-length": "10"}) == "ok"
    # A bearer token cannot come from a page without a CORS preflight: not checked.
    admin_token = token(("inference", "admin"))
    assert browser("POST", "/tokens", admin_token, authorization="Bearer my-x", **text,
                   **evil) == "ok"


def test_the_gates_headers_answer_as_starlettes_do() -> None:
    """RequestHeaders replaced Starlette's Headers in the gate: the same answers (the first of a
    repeated name, any case of the name asked), read in one pass."""
    from starlette.datastructures import Headers

    raw = [(b"host", b"a.example"), (b"x-api-key", b"k1"), (b"x-api-key", b"k2"),
           (b"content-type", b"application/json")]
    ours, theirs = RequestHeaders(raw), Headers(raw=raw)
    for name in ("host", "X-Api-Key", "x-api-key", "content-type", "cookie", "Origin"):
        assert ours.get(name) == theirs.get(name), name
        assert ours.get(name, "") == theirs.get(name, ""), name
        assert (name in ours) == (name in theirs), name
    assert ours["X-API-KEY"] == theirs["X-API-KEY"] == "k1"
    with pytest.raises(KeyError):
        ours["cookie"]
