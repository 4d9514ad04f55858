"""X-Modelyard-Priority (issue 31 §9): only admins may raise it; everyone else may lower it."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from modelyard.errors import InvalidRequest
from modelyard.front.identity.principal import ANONYMOUS_ADMIN, ANONYMOUS_INFERENCE, Principal
from modelyard.front.state import PRIORITY_MAX, PRIORITY_MIN, request_priority

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

BOB = Principal("bob", False, frozenset({"inference"}), "token", "t1")
ROOT = Principal("root", True, frozenset({"inference", "admin"}), "token", "t2")


def request(principal: Principal, priority: str | None) -> Request:
    headers = [] if priority is None else [(b"x-modelyard-priority", priority.encode())]
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                    "headers": headers, "modelyard.principal": principal})


@pytest.mark.parametrize("caller", [ANONYMOUS_INFERENCE, BOB])
def test_a_caller_without_the_admin_scope_may_only_lower_its_priority(caller: Principal) -> None:
    assert request_priority(request(caller, None)) == 0
    assert request_priority(request(caller, "1000000")) == 0  # was admitted ahead of everyone
    assert request_priority(request(caller, "5")) == 0
    assert request_priority(request(caller, "-100")) == -100  # a background job yields
    assert request_priority(request(caller, "-99999999")) == PRIORITY_MIN


@pytest.mark.parametrize("caller", [ROOT, ANONYMOUS_ADMIN])  # auth `none`: everyone is admin
def test_an_admin_may_raise_it_within_bounds(caller: Principal) -> None:
    assert request_priority(request(caller, "50")) == 50
    assert request_priority(request(caller, "99999999")) == PRIORITY_MAX
    assert request_priority(request(caller, "-99999999")) == PRIORITY_MIN


def test_a_priority_that_is_no_integer_is_a_400() -> None:
    with pytest.raises(InvalidRequest) as refused:
        request_priority(request(BOB, "high"))
    assert refused.value.status == 400 and refused.value.param == "priority"
    with pytest.raises(InvalidRequest):
        request_priority(request(BOB, "9" * 5000))  # past Python's int() digit limit
