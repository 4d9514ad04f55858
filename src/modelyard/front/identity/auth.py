"""Who may call what: the gate every public request passes before its handler.

Route classes (the whole policy is `route_class` plus `AuthGate._decide`):

    public     /health, the login page and its assets, POST /auth/login: never need auth
    inference  the generating and listing APIs (/v1/*, Ollama's chat/generate/embed/tags/ps/show,
               native /chat /models /status /diag, /metrics): open on loopback with auth
               `auto` (/metrics shows what /status does: a scraper needs no admin token)
    user       /auth/*, /archive*, /studio/events, /activity*: need a real identity
    account    /tokens*, POST /auth/password, PATCH /auth/me: the account's keys and
               settings; need a login session or an admin-scope token (an inference token
               must not mint, list or revoke tokens nor change the password or the
               preferences of the user it belongs to)
    admin      everything else (/admin/*, pulls and jobs, deleting models): need the admin scope

Identity comes from `Authorization: Bearer my-…` (an API token; or `x-api-key: my-…`, as
Anthropic's SDKs send it) or the signed session cookie of
the Web Studio; state-changing requests made with the cookie must carry `X-CSRF-Token`. A
modelyard token (`my-…`) that is unknown, revoked or expired is a 401 on every route, open ones
too: a caller whose token stopped working must not go on as anonymous, out of its user's limits.
Any other key on an open route is ignored (it names nobody: the `openai` SDK always sends one).
The gate also refuses a `Host` that is not the bound name (DNS rebinding) and bodies over
`max_body_bytes`. It is plain ASGI so streamed responses pass through untouched.

Requests a web page could make with the browser's ambient authority (the cookie, or nothing on
an open loopback server) are refused when they change state from another site: an `Origin` that
is not this server's (nor in `cors_origins` or `allowed_hosts`) is 403 `origin_not_allowed`; the
login and cookie requests must send JSON (415 otherwise: `text/plain` needs no CORS preflight),
but for the Studio's batch upload (multipart POST /v1/files, with its X-CSRF-Token header).
Bearer-token requests are not checked: a page can only send a token after a CORS preflight.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import ipaddress
import os
import secrets
import time
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, overload
from urllib.parse import urlsplit

import sqlalchemy as sa
from itsdangerous import BadSignature, URLSafeTimedSerializer
from starlette.routing import Match
from starlette.types import Message, Receive, Scope

from modelyard.config import Settings
from modelyard.errors import (
    CsrfFailed,
    Forbidden,
    HostNotAllowed,
    OriginNotAllowed,
    PasswordChangeRequired,
    PayloadTooLarge,
    Unauthorized,
    UnsupportedMediaType,
)
from modelyard.front.identity import accounts, tokens
from modelyard.front.identity.cors import is_default_origin
from modelyard.front.identity.login_throttle import LoginThrottle
from modelyard.front.identity.login_throttle_db import SharedLoginThrottle
from modelyard.front.identity.principal import (
    ANONYMOUS_ADMIN,
    ANONYMOUS_INFERENCE,
    Principal,
)

# The web login's cookie. Its name (and the signing salt below) keep the word "session" that
# browsers and clients already hold; only the Python names say "login".
LOGIN_COOKIE = "modelyard_session"
CSRF_HEADER = "x-csrf-token"
# Anthropic's SDKs send the API key here, not in Authorization: read like a bearer token.
API_KEY_HEADER = "x-api-key"
SECRET_KEY_FILE = "secret-key"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_TOKEN_CACHE_S = 2.0  # a token revoked by another process (the CLI) stops working within this


class RouteClass(StrEnum):
    PUBLIC = "public"
    INFERENCE = "inference"
    USER = "user"
    ACCOUNT = "account"
    ADMIN = "admin"


_PUBLIC = {("GET", "/health"), ("GET", "/"), ("GET", "/login"), ("POST", "/auth/login")}
_PUBLIC.add(("GET", "/openapi.json"))  # the API's description: what the source says
_PUBLIC_PREFIXES = ("/studio/assets/",)
FILES_PATH = "/v1/files"  # uploads of batch inputs (front/api/batches.py)
_MULTIPART_SLACK = 64 * 1024  # the form's boundaries and part headers around the file
BLOB_PREFIX = "/api/blobs/"  # Ollama's model-file uploads (front/api/ollama_create.py)
_INFERENCE_EXACT = {
    ("POST", "/chat"), ("GET", "/models"), ("GET", "/status"), ("GET", "/diag"),
    ("POST", "/api/chat"), ("POST", "/api/generate"), ("POST", "/api/embed"),
    ("POST", "/api/embeddings"), ("GET", "/api/tags"), ("GET", "/api/ps"), ("POST", "/api/show"),
    ("GET", "/api/version"), ("GET", "/metrics"), ("POST", "/rerank"),
}
_USER_PREFIXES = ("/auth/", "/archive", "/studio/events", "/activity")
_ACCOUNT_EXACT = {("POST", "/auth/password"), ("PATCH", "/auth/me")}
# While a session must change its password it may do only this.
_PASSWORD_CHANGE_ROUTES = {"/auth/me", "/auth/password", "/auth/logout"}


def route_class(method: str, path: str) -> RouteClass:
    method = "GET" if method == "HEAD" else method
    if (method, path) in _PUBLIC or (method == "GET" and path.startswith(_PUBLIC_PREFIXES)):
        return RouteClass.PUBLIC
    if path.startswith("/v1/") or (method, path) in _INFERENCE_EXACT:
        return RouteClass.INFERENCE
    if path == "/tokens" or path.startswith("/tokens/") or (method, path) in _ACCOUNT_EXACT:
        return RouteClass.ACCOUNT
    if path.startswith(_USER_PREFIXES):
        return RouteClass.USER
    return RouteClass.ADMIN


@functools.lru_cache(maxsize=256)  # every request asks about the bind address: parse it once
def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "[::]", "")


def check_bind(settings: Settings) -> None:
    """`auth: none` off loopback would hand every model and the admin API to the network."""
    if settings.auth == "none" and not is_loopback(settings.host):
        raise ValueError(
            f"auth: none is accepted only on a loopback address, and host is {settings.host}. "
            "Bind 127.0.0.1 (--host 127.0.0.1), or keep auth `auto`/`required` and create a "
            "token: `modelyard tokens create NAME`."
        )


def allowed_host_names(settings: Settings) -> frozenset[str] | None:
    """Host names requests may name; None: any (a wildcard bind with no allowed_hosts)."""
    names = {h.lower() for h in settings.allowed_hosts}
    if _is_wildcard(settings.host):
        return frozenset(names | {"localhost", "127.0.0.1", "::1"}) if names else None
    names.add(settings.host.strip("[]").lower())
    if is_loopback(settings.host):
        names |= {"localhost", "127.0.0.1", "::1"}
    return frozenset(names)


def host_name(header: str) -> str:
    """`example.org:8770` → `example.org`; `[::1]:8770` → `::1`."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0].lower()
    return header.rsplit(":", 1)[0].lower() if header.count(":") == 1 else header.lower()


def load_secret_key(home: Path) -> str:
    """The cookie-signing key, made once per directory (mode 0600): $MODELYARD_HOME, or the
    `shared_dir` of several fronts, so a cookie one front signed is valid on every front."""
    path = home / SECRET_KEY_FILE
    if not path.exists():
        # Written whole under a name of our own, then linked into place: link fails if the
        # key is there, so fronts starting together on one shared_dir all read the same key.
        mine = path.with_name(f"{path.name}.{secrets.token_hex(8)}.tmp")
        tokens.write_secret_file(mine, secrets.token_urlsafe(48))
        try:
            with contextlib.suppress(FileExistsError):  # another process made it first
                os.link(mine, path)
        finally:
            mine.unlink(missing_ok=True)
    return path.read_text().strip()


@dataclass
class Identified:
    principal: Principal
    login: accounts.LoginSession | None = None


class Auth:
    """Identifies callers: sessions (signed cookie → session row) and bearer tokens."""

    def __init__(self, settings: Settings, database: sa.Engine, secret_key: str) -> None:
        self.settings = settings
        self.db = database
        self.cookies = URLSafeTimedSerializer(secret_key, salt="modelyard-session")
        self._tokens: dict[str, tuple[float, tokens.Token | None]] = {}
        # Lookups in flight, by hash: the requests that find the cache cold at once (a burst
        # of streams with one token, every _TOKEN_CACHE_S) share one database query.
        self._looking: dict[str, asyncio.Future[tokens.Token | None]] = {}
        self._generation = 0  # moved by forget_tokens: a lookup begun before it is not cached
        # Several worker processes count failed logins together, in the database: else each
        # would allow its own share of guesses (login_throttle_db.py).
        self.logins = (SharedLoginThrottle(database) if settings.worker_count > 1
                       else LoginThrottle())
        # A key of its own for pseudonyms, derived from the cookie key (never the key itself).
        self._pseudonym_key = hmac.new(secret_key.encode(), b"modelyard user pseudonym",
                                       hashlib.sha256).digest()

    def pseudonym(self, name: str) -> str:
        """A user's name as callers without the admin scope see it where names of others would
        show (the usage metrics' `owner` label): the same on every front sharing the secret
        key and across restarts, so series and dashboards hold, and no guess of a name can be
        checked against it without the key."""
        digest = hmac.new(self._pseudonym_key, name.encode(), hashlib.sha256).hexdigest()
        return f"u-{digest[:16]}"

    def forget_tokens(self) -> None:
        """After a revocation here: it takes effect on the next request."""
        self._tokens.clear()
        self._looking.clear()
        self._generation += 1

    async def by_token_id(self, token_id: str) -> tokens.Token | None:
        return await asyncio.to_thread(tokens.get_token, self.db, token_id)

    def cookie_value(self, login: accounts.LoginSession) -> str:
        return self.cookies.dumps(login.id)

    async def by_token(self, secret: str) -> tokens.Token | None:
        key = tokens.hash_secret(secret)
        cached = self._tokens.get(key)
        now = time.monotonic()
        if cached is not None and now - cached[0] < _TOKEN_CACHE_S:
            token = cached[1]
        else:
            looking = self._looking.get(key)
            if looking is None:
                looking = self._looking[key] = asyncio.ensure_future(
                    self._look_up(key, secret, now))
                looking.add_done_callback(_retrieved)  # a failure all its waiters left
            # Shielded: one waiter that leaves (its client gave up) does not cancel the others'.
            token = await asyncio.shield(looking)
        if token is not None and token.expires_at is not None and token.expires_at <= time.time():
            return None
        return token

    async def _look_up(self, key: str, secret: str, now: float) -> tokens.Token | None:
        generation = self._generation
        try:
            token = await asyncio.to_thread(tokens.find_token, self.db, secret)
        finally:
            if generation == self._generation:
                self._looking.pop(key, None)
        if generation == self._generation:  # else a revocation came meanwhile: not kept
            if len(self._tokens) > 10_000:
                self._tokens.clear()
            self._tokens[key] = (now, token)
        return token

    async def by_cookie(self, value: str) -> accounts.LoginSession | None:
        try:
            login_id = self.cookies.loads(value, max_age=int(self.settings.session_ttl_s))
        except BadSignature:
            return None
        return await asyncio.to_thread(accounts.find_login_session, self.db, str(login_id))

    async def identify(self, headers: RequestHeaders) -> tuple[Identified | None, bool]:
        """(who, whether a modelyard token (`my-…`) was given but is not valid)."""
        authorization = headers.get("authorization", "")
        scheme, _, secret = authorization.partition(" ")
        if scheme.lower() != "bearer" and headers.get(API_KEY_HEADER, "").strip():
            scheme, secret = "bearer", headers[API_KEY_HEADER]  # Anthropic's SDKs send this
        if scheme.lower() == "bearer" and secret.strip():
            token = await self.by_token(secret.strip())
            if token is None:  # a key not of our form names nobody: like none (clients'
                return None, secret.strip().startswith(tokens.PREFIX)  # dummy keys)
            return Identified(token_principal(token)), False
        cookie = _cookie(headers, LOGIN_COOKIE)
        if cookie:
            login = await self.by_cookie(cookie)
            if login is not None:
                return Identified(login_principal(login.user), login), False
        return None, False


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def login_principal(user: accounts.User) -> Principal:
    scopes = frozenset({"inference", "admin"} if user.is_admin else {"inference"})
    return Principal(user.name, user.is_admin, scopes, "session",
                     archive_retention=user.archive_retention, group=user.group)


def token_principal(token: tokens.Token) -> Principal:
    # An admin scope counts only while the owner is still an admin.
    scopes = frozenset(s for s in token.scopes if s != "admin" or token.owner_is_admin)
    return Principal(token.owner, "admin" in scopes, scopes, "token", token.id,
                     token.archive_retention or token.owner_retention, token.owner_group)


class RequestHeaders:
    """A request's headers as the gate reads them: one pass over the ASGI list into a dict
    (names come lowercased), the first of a repeated name winning as with Starlette's
    `Headers.get`, whose scan of the list per lookup the gate's dozen lookups paid per request."""

    __slots__ = ("_by_name",)

    def __init__(self, raw: Iterable[tuple[bytes, bytes]]) -> None:
        by_name: dict[str, str] = {}
        for name, value in raw:
            key = name.decode("latin-1")
            if key not in by_name:
                by_name[key] = value.decode("latin-1")
        self._by_name = by_name

    @overload
    def get(self, name: str) -> str | None: ...

    @overload
    def get(self, name: str, default: str) -> str: ...

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._by_name.get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return self._by_name[name.lower()]

    def __contains__(self, name: str) -> bool:
        return name.lower() in self._by_name


def _cookie(headers: RequestHeaders, name: str) -> str | None:
    for part in headers.get("cookie", "").split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return None


def decide(settings: Settings, cls: RouteClass, method: str, path: str,
           who: Identified | None, bad_token: bool, csrf_header: str | None) -> Principal:
    """The principal a request runs as, or the error that refuses it."""
    mode = settings.auth
    open_inference = mode == "none" or (mode == "auto" and is_loopback(settings.host))
    if cls is RouteClass.PUBLIC:
        return who.principal if who else ANONYMOUS_INFERENCE
    if who is None:
        # A token of ours that no longer works is refused even where no token is needed: its
        # caller would otherwise go on as anonymous, out of the limits of the token's user.
        if bad_token:
            raise Unauthorized("the bearer token is not valid (unknown, revoked or expired)")
        # Another key on an open route is ignored, as by Ollama: clients often send a dummy one.
        if mode == "none":
            return ANONYMOUS_ADMIN
        if cls is RouteClass.INFERENCE and open_inference:
            return ANONYMOUS_INFERENCE
        raise Unauthorized(
            "this route needs authentication: log in to the Web Studio, or send "
            "`Authorization: Bearer <token>` (`modelyard tokens create NAME` makes one)")
    principal = who.principal
    if who.login is not None:
        if who.login.user.must_change_password and path not in _PASSWORD_CHANGE_ROUTES:
            raise PasswordChangeRequired(
                "change the one-time password first (POST /auth/password or the Studio)")
        if method not in _SAFE_METHODS and csrf_header != who.login.csrf:
            raise CsrfFailed("missing or wrong X-CSRF-Token header (it comes with the login "
                             "and from GET /auth/me)")
    if mode == "none":
        return replace(principal, is_admin=True, scopes=ANONYMOUS_ADMIN.scopes)
    if cls is RouteClass.ADMIN and not principal.can("admin"):
        raise Forbidden("this route needs the admin scope (an admin's login or admin token)")
    if cls is RouteClass.ACCOUNT and who.login is None and not principal.can("admin"):
        raise Forbidden("managing tokens, the password and the account's settings needs a "
                        "login (the Web Studio) or an admin token; an inference token cannot")
    if cls is RouteClass.INFERENCE and not principal.can("inference"):
        raise Forbidden("this token lacks the inference scope")
    return principal


class AuthGate:
    """The edge's identity step (front/api/edge.py): Host check, body limit, identity, policy."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.hosts = allowed_host_names(settings)

    async def admit(self, scope: Scope, receive: Receive) -> Receive:
        """Attach the caller's principal to `scope` (`modelyard.principal`, and the login
        session's id for a Studio login) and answer the `receive` the request goes on with (its
        body limited); a request refused raises its ModelyardError."""
        path: str = scope["path"]
        # A batch line the front's own runner sends in process (front/batches/runner.py): its
        # owner's principal is in the scope, which no client can set. Nothing to check.
        preset: Principal | None = scope.get("modelyard.batch_principal")
        if preset is not None:
            scope["modelyard.principal"] = preset
            return receive
        headers = RequestHeaders(scope["headers"])
        self._check_host(headers)
        # An admin's blob upload (/api/create's model files) is a whole model, not a
        # request body: limited by the disk, not by max_body_bytes (checked once we know).
        blob = scope["method"] == "POST" and path.startswith(BLOB_PREFIX)
        if not blob:  # a batch input (POST /v1/files) is held to files_max_bytes
            if path == FILES_PATH and scope["method"] == "POST":
                receive = self._limit_body(
                    headers, receive, self.settings.files_max_bytes + _MULTIPART_SLACK,
                    "files_max_bytes")
            else:
                receive = self._limit_body(headers, receive)
        auth: Auth = scope["app"].state.front.identity.auth
        cls = route_class(scope["method"], path)
        who, bad_token = (None, False)
        if cls is not RouteClass.PUBLIC or headers.get("cookie") or headers.get(
                "authorization"):
            who, bad_token = await auth.identify(headers)
        check_browser_request(self.settings, scope["method"], path, headers, who)
        try:
            principal = decide(self.settings, cls, scope["method"], path, who, bad_token,
                               headers.get(CSRF_HEADER))
        except (Unauthorized, Forbidden):
            if _routed(scope):
                raise
            principal = ANONYMOUS_INFERENCE  # no such route: let the router say 404/405
        if blob and not principal.is_admin:
            receive = self._limit_body(headers, receive)
        scope["modelyard.principal"] = principal
        if who is not None and who.login is not None:
            scope["modelyard.login_session"] = who.login
        return receive

    def _check_host(self, headers: RequestHeaders) -> None:
        if self.hosts is None:
            return
        name = host_name(headers.get("host", ""))
        if name not in self.hosts:
            raise HostNotAllowed(
                f"Host {name or '(none)'!r} is not a name this server answers to; add it to "
                "`allowed_hosts` if it is yours")

    def _limit_body(self, headers: RequestHeaders, receive: Receive, limit: int | None = None,
                    setting: str = "max_body_bytes") -> Receive:
        """`receive`, refusing a body over `limit` (413 naming `setting`, the option to raise)."""
        limit = limit or self.settings.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise PayloadTooLarge(f"the request body is {length} bytes; the limit is {limit} "
                                  f"({setting})")
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise PayloadTooLarge(f"the request body exceeds the limit of {limit} bytes "
                                          f"({setting})")
            return message

        return counted


def _netloc(host: str) -> str:
    """`Example.org:80` → `example.org`: default ports dropped, as browsers drop them."""
    host = host.lower()
    for default in (":80", ":443"):
        if host.endswith(default):
            return host.removesuffix(default)
    return host


def origin_allowed(settings: Settings, origin: str, host_header: str) -> bool:
    """This server's own origin (the Host the request came to), a configured CORS origin, or
    a name configured in `allowed_hosts` (a reverse proxy that rewrites Host)."""
    configured = {o.rstrip("/") for o in settings.cors_origins}
    if "*" in configured or origin.rstrip("/") in configured:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False  # `null` (sandboxed frames, file: pages) and anything odd
    if _netloc(parts.netloc) == _netloc(host_header):
        return True
    return (parts.hostname or "") in {h.lower() for h in settings.allowed_hosts}


def _media(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def _json_media(content_type: str) -> bool:
    media = _media(content_type)
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


def check_browser_request(settings: Settings, method: str, path: str, headers: RequestHeaders,
                          who: Identified | None) -> None:
    """Cross-site request forgery, beyond the CSRF header: a state change a web page could make
    with the browser's ambient authority (its cookie, or none on an open loopback server) must
    come from this server's own pages, and the login and cookie requests must send JSON (a page
    sends `text/plain` without a CORS preflight). A request with an Authorization header is
    not checked: a page could send one only after a preflight our CORS settings allowed."""
    method = "GET" if method == "HEAD" else method
    is_login = (method, path) == ("POST", "/auth/login")
    if method in _SAFE_METHODS or ((headers.get("authorization") or headers.get(API_KEY_HEADER))
                                   and not is_login):
        return
    origin = headers.get("origin")
    with_cookie = who is not None and who.login is not None
    # A local page (Ollama's default origins, front/identity/cors.py) may call the Ollama and
    # OpenAI APIs as it may call Ollama's, but never with the Studio's login cookie, and never
    # modelyard's own admin, account or login routes.
    local = (origin is not None and is_default_origin(origin) and not with_cookie
             and path.startswith(("/api/", "/v1/")))
    if origin is not None and not local and not origin_allowed(
            settings, origin, headers.get("host", "")):
        raise OriginNotAllowed(
            f"a request from the page of another site ({origin}) may not change anything here; "
            "list that origin in `cors_origins` if it is yours")
    has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
    content_type = headers.get("content-type", "")
    # The Studio's batch upload (POST /v1/files) is a file, so multipart: with the cookie it
    # still needs the X-CSRF-Token header (`decide`), which no cross-site form can send.
    studio_upload = (with_cookie and (method, path) == ("POST", FILES_PATH)
                     and _media(content_type) == "multipart/form-data")
    if (is_login or (with_cookie and has_body and not studio_upload)) and not _json_media(
            content_type):
        raise UnsupportedMediaType(
            f"this request must send `Content-Type: application/json`, not "
            f"{headers.get('content-type') or 'none'!r}")


def _routed(scope: Scope) -> bool:
    """Some route of the app answers this path (with this method or another)."""
    return any(route.matches(scope)[0] is not Match.NONE
               for route in scope["app"].router.routes)


def cookie_header(value: str, *, max_age_s: float, secure: bool) -> str:
    parts = [f"{LOGIN_COOKIE}={value}", "Path=/", "HttpOnly", "SameSite=Lax",
             f"Max-Age={int(max_age_s)}"]
    if secure:
        parts.append("Secure")
    return "; ".join(parts)


def login_session_of(scope: MutableMapping[str, Any]) -> accounts.LoginSession | None:
    login = scope.get("modelyard.login_session")
    assert login is None or isinstance(login, accounts.LoginSession)
    return login
