"""Who is calling: the identity the auth middleware attaches to every request.

Handlers read it with `principal_of(request)`; they never look at cookies or headers themselves.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal

from starlette.requests import Request

from modelyard.errors import Forbidden

Scope = Literal["inference", "admin"]
# "session" is a web login (GET /auth/me shows `via`, so the value stays as clients know it).
Via = Literal["session", "token", "anonymous"]


@dataclass(frozen=True)
class Principal:
    user: str | None  # None: an anonymous caller (loopback with auth `auto`, or auth `none`)
    is_admin: bool  # may act on everything, other users' archive items included
    scopes: frozenset[str]
    via: Via
    token_id: str | None = None
    archive_retention: str | None = None  # the token's or the user's default, else None
    group: str | None = None  # the user's group (teams: limits and fair-share weights)

    def can(self, scope: Scope) -> bool:
        return scope in self.scopes

    def may_see(self, owner: str | None) -> bool:
        """Archive items, jobs, tokens: an owner sees their own, admins see all."""
        return self.is_admin or (self.user is not None and owner == self.user)


ANONYMOUS_INFERENCE = Principal(None, False, frozenset({"inference"}), "anonymous")
ANONYMOUS_ADMIN = Principal(None, True, frozenset({"inference", "admin"}), "anonymous")


# The principal of the request being served, for code below the handlers that has no `Request`
# (the dispatcher's fair share, the batch runner sets its batch's owner). None: no request.
CURRENT_PRINCIPAL: ContextVar[Principal | None] = ContextVar("modelyard_principal", default=None)


def owner_key(principal: Principal | None) -> str:
    """Whom a request is accounted to for fair share and limits: the user's name, "" for
    anonymous callers (one owner together)."""
    return "" if principal is None or principal.user is None else principal.user


def principal_of(request: Request) -> Principal:
    principal = request.scope.get("modelyard.principal")
    if principal is None:  # the middleware always sets it; a missing one is a wiring bug
        raise Forbidden("no identity attached to this request")
    assert isinstance(principal, Principal)
    return principal
