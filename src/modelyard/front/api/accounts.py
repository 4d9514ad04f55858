"""Logins, API tokens and users.

    POST   /auth/login        {"username", "password"} → session cookie + {"user", "csrf_token"}
                              (failures throttled per user and address: 429 + Retry-After)
    GET    /auth/me           who is calling (+ the CSRF token of a session)
    PATCH  /auth/me           {"archive_retention": "1d"}: the caller's default retention
    POST   /auth/logout       ends the session
    POST   /auth/password     {"current_password", "new_password"}
    GET    /tokens            own tokens (an admin: every token)
    POST   /tokens            {"name", "scopes", "expires_in_s", "owner", "archive_retention"}
    DELETE /tokens/{id}       revokes it and the tokens minted from it
    (/tokens* and POST /auth/password need a login session or an admin token:
    auth.py's `account` class; a token minted with a token is bounded by it)
    GET    /admin/users       POST /admin/users {"name", "password", "is_admin"}
    DELETE /admin/users/{name}
    POST   /admin/users/{name}/password   {"password"}: the user must change it at next login
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelyard.config import ArchiveRetention
from modelyard.errors import Conflict, Forbidden, InvalidRequest, Unauthorized
from modelyard.front.identity import accounts, tokens
from modelyard.front.identity.auth import Auth, cookie_header, login_session_of
from modelyard.front.identity.login_throttle import LoginThrottle
from modelyard.front.identity.principal import Principal, principal_of
from modelyard.front.state import read_json_object, state_of, validate


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status_code=status, headers=headers,
                    media_type="application/json")


def _auth(request: Request) -> Auth:
    return state_of(request).identity.auth


def _user_name(principal: Principal) -> str:
    if principal.user is None:
        raise Unauthorized("this needs a user: log in, or send a user's token")
    return principal.user


class Login(BaseModel):
    model_config = ConfigDict(extra="forbid")

    username: str = Field(min_length=1, max_length=64)
    password: str = Field(min_length=1, max_length=1024)


async def _start_login_session(request: Request, auth: Auth, user: accounts.User,
                         status: int = 200) -> Response:
    login = await asyncio.to_thread(accounts.open_login_session, auth.db, user,
                                      auth.settings.session_ttl_s)
    cookie = cookie_header(auth.cookie_value(login), max_age_s=auth.settings.session_ttl_s,
                           secure=request.url.scheme == "https")
    return _json({"user": user.public(), "csrf_token": login.csrf}, status,
                 {"Set-Cookie": cookie})


async def _throttle(throttle: LoginThrottle, user: str, address: str | None, *,
                    succeeded: bool = False) -> None:
    """A step of the login throttle: inline when it is in memory, else off the loop (the
    database's, under `serve --workers N`: front/identity/login_throttle_db.py)."""
    step = throttle.succeeded if succeeded else throttle.attempt
    if throttle.blocking:
        await asyncio.to_thread(step, user, address)
    else:
        step(user, address)


async def login(request: Request) -> Response:
    auth = _auth(request)
    req = validate(Login, await read_json_object(request))
    address = request.client.host if request.client else None
    await _throttle(auth.logins, req.username, address)  # 429 while blocked
    user = await asyncio.to_thread(accounts.verify_password, auth.db, req.username, req.password)
    if user is None:
        raise Unauthorized("wrong user name or password")
    await _throttle(auth.logins, req.username, address, succeeded=True)
    return await _start_login_session(request, auth, user)


# Who `auth: none` serves when nobody logged in: the Studio shows it as an admin.
_NOBODY = {"name": "anonymous", "is_admin": True, "must_change_password": False,
           "archive_retention": None, "created_at": None}


async def me(request: Request) -> Response:
    principal = principal_of(request)
    login = login_session_of(request.scope)
    if principal.user is None and _auth(request).settings.auth == "none":
        return _json({"user": _NOBODY, "via": "anonymous", "scopes": sorted(principal.scopes),
                      "csrf_token": None})
    user = await asyncio.to_thread(accounts.get_user, _auth(request).db, _user_name(principal))
    if user is None:
        raise Unauthorized("this user no longer exists")
    return _json({"user": user.public(), "via": principal.via,
                  "scopes": sorted(principal.scopes),
                  "csrf_token": login.csrf if login else None})


class Preferences(BaseModel):
    model_config = ConfigDict(extra="forbid")

    archive_retention: ArchiveRetention | None


async def update_me(request: Request) -> Response:
    auth = _auth(request)
    name = _user_name(principal_of(request))
    req = validate(Preferences, await read_json_object(request))
    await asyncio.to_thread(accounts.set_archive_retention, auth.db, name, req.archive_retention)
    auth.forget_tokens()  # tokens carry their owner's default
    user = await asyncio.to_thread(accounts.get_user, auth.db, name)
    assert user is not None
    return _json({"user": user.public()})


async def logout(request: Request) -> Response:
    login = login_session_of(request.scope)
    if login is not None:
        await asyncio.to_thread(accounts.close_login_session, _auth(request).db, login.id)
    expired = cookie_header("", max_age_s=0, secure=request.url.scheme == "https")
    return _json({"status": "logged_out"}, headers={"Set-Cookie": expired})


class PasswordChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    current_password: str = Field(min_length=1, max_length=1024)
    new_password: str = Field(max_length=1024)


async def change_password(request: Request) -> Response:
    """Every session of the user ends (other browsers too); the caller gets a fresh one."""
    auth = _auth(request)
    name = _user_name(principal_of(request))
    req = validate(PasswordChange, await read_json_object(request))
    if await asyncio.to_thread(accounts.verify_password, auth.db, name,
                               req.current_password) is None:
        raise Forbidden("the current password is wrong", param="current_password")
    if req.new_password == req.current_password:
        raise InvalidRequest("the new password must differ from the current one",
                             param="new_password")
    await asyncio.to_thread(accounts.set_password, auth.db, name, req.new_password,
                            must_change_password=False, home=auth.settings.home)
    auth.forget_tokens()  # the user's tokens were revoked with the old password
    user = await asyncio.to_thread(accounts.get_user, auth.db, name)
    assert user is not None
    if login_session_of(request.scope) is None:
        return _json({"status": "changed", "user": user.public()})
    return await _start_login_session(request, auth, user)


# ---- tokens ------------------------------------------------------------------------------------


class NewToken(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    scopes: list[str] = Field(default_factory=lambda: ["inference"])
    expires_in_s: float | None = Field(None, gt=0)
    owner: str | None = None
    archive_retention: ArchiveRetention | None = None


async def list_tokens(request: Request) -> Response:
    principal = principal_of(request)
    owner = None if principal.is_admin else _user_name(principal)
    found = await asyncio.to_thread(tokens.list_tokens, _auth(request).db, owner)
    return _json({"tokens": [t.public() for t in found]})


async def create_token(request: Request) -> Response:
    principal = principal_of(request)
    auth = _auth(request)
    req = validate(NewToken, await read_json_object(request))
    owner = req.owner or _user_name(principal)
    if owner != principal.user and not principal.is_admin:
        raise Forbidden("only an admin creates tokens for someone else", param="owner")
    if "admin" in req.scopes and not principal.can("admin"):
        raise Forbidden("a token cannot grant more than its creator has", param="scopes")
    parent = None
    if principal.token_id is not None:  # minted with a token: bounded by it, revoked with it
        parent = await auth.by_token_id(principal.token_id)
        if parent is None:
            raise Unauthorized("the bearer token is not valid (unknown, revoked or expired)")
    token, secret = await asyncio.to_thread(
        tokens.create_token, auth.db, owner, req.name, req.scopes,
        expires_in_s=req.expires_in_s, archive_retention=req.archive_retention, parent=parent)
    return _json({**token.public(), "token": secret}, 201)


async def revoke_token(request: Request) -> Response:
    principal = principal_of(request)
    owner = None if principal.is_admin else _user_name(principal)
    auth = _auth(request)
    await asyncio.to_thread(tokens.revoke_token, auth.db, request.path_params["token_id"], owner)
    auth.forget_tokens()
    return _json({"status": "revoked", "id": request.path_params["token_id"]})


# ---- users (admin routes) ---------------------------------------------------------------------


class NewUser(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    password: str = Field(max_length=1024)
    is_admin: bool = False
    must_change_password: bool = True


class PasswordReset(BaseModel):
    model_config = ConfigDict(extra="forbid")

    password: str = Field(max_length=1024)


async def list_users(request: Request) -> Response:
    users = await asyncio.to_thread(accounts.list_users, _auth(request).db)
    return _json({"users": [u.public() for u in users]})


async def add_user(request: Request) -> Response:
    req = validate(NewUser, await read_json_object(request))
    user = await asyncio.to_thread(
        accounts.add_user, _auth(request).db, req.name, req.password, is_admin=req.is_admin,
        must_change_password=req.must_change_password)
    return _json(user.public(), 201)


async def remove_user(request: Request) -> Response:
    auth = _auth(request)
    name = request.path_params["name"]
    users = await asyncio.to_thread(accounts.list_users, auth.db)
    admins = [u.name for u in users if u.is_admin]
    if admins == [name]:
        raise Conflict("this is the last admin; make another admin first", param="name")
    await asyncio.to_thread(accounts.remove_user, auth.db, name)
    auth.forget_tokens()
    return _json({"status": "removed", "name": name})


async def reset_password(request: Request) -> Response:
    """The user's sessions end and their tokens are revoked (accounts.set_password)."""
    auth = _auth(request)
    req = validate(PasswordReset, await read_json_object(request))
    await asyncio.to_thread(accounts.set_password, auth.db, request.path_params["name"],
                            req.password, must_change_password=True, home=auth.settings.home)
    auth.forget_tokens()
    return _json({"status": "reset", "name": request.path_params["name"]})


routes = [
    Route("/auth/login", login, methods=["POST"]),
    Route("/auth/me", me, methods=["GET"]),
    Route("/auth/me", update_me, methods=["PATCH"]),
    Route("/auth/logout", logout, methods=["POST"]),
    Route("/auth/password", change_password, methods=["POST"]),
    Route("/tokens", list_tokens, methods=["GET"]),
    Route("/tokens", create_token, methods=["POST"]),
    Route("/tokens/{token_id}", revoke_token, methods=["DELETE"]),
    Route("/admin/users", list_users, methods=["GET"]),
    Route("/admin/users", add_user, methods=["POST"]),
    Route("/admin/users/{name}", remove_user, methods=["DELETE"]),
    Route("/admin/users/{name}/password", reset_password, methods=["POST"]),
]
