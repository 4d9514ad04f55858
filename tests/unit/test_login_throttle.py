"""Failed-login throttling (issue 15 §11) on an injected clock: no sleeps."""

from __future__ import annotations

import pytest

from modelyard.errors import TooManyAttempts
from modelyard.front.identity.login_throttle import (
    ADDRESS_FREE_FAILURES,
    FIRST_BLOCK_S,
    FORGET_AFTER_S,
    MAX_BLOCK_S,
    USER_FREE_FAILURES,
    LoginThrottle,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def blocked_for(throttle: LoginThrottle, user: str, address: str | None) -> float | None:
    try:
        throttle.attempt(user, address)
    except TooManyAttempts as exc:
        assert exc.status == 429 and exc.headers()["Retry-After"]
        return exc.retry_after_s
    return None


def test_a_user_gets_a_few_free_failures_then_doubling_blocks() -> None:
    clock = Clock()
    throttle = LoginThrottle(clock)
    for _ in range(USER_FREE_FAILURES):
        assert blocked_for(throttle, "admin", "10.0.0.1") is None
    assert blocked_for(throttle, "admin", "10.0.0.2") == FIRST_BLOCK_S  # any address
    assert blocked_for(throttle, "ADMIN", None) == FIRST_BLOCK_S  # names are case-blind
    assert blocked_for(throttle, "bob", "10.0.0.3") is None  # another user is not blocked
    clock.now += FIRST_BLOCK_S
    assert blocked_for(throttle, "admin", "10.0.0.1") is None  # one more try, then longer
    assert blocked_for(throttle, "admin", "10.0.0.1") == 2 * FIRST_BLOCK_S
    for _ in range(20):
        clock.now += MAX_BLOCK_S
        throttle.attempt("admin", "10.0.0.1")
    assert blocked_for(throttle, "admin", "10.0.0.1") == MAX_BLOCK_S  # capped


def test_success_clears_the_user_and_quiet_time_forgets() -> None:
    clock = Clock()
    throttle = LoginThrottle(clock)
    for _ in range(USER_FREE_FAILURES - 1):
        throttle.attempt("carol", "10.0.0.1")
    throttle.attempt("carol", "10.0.0.1")  # the 5th attempt ... was the right password
    throttle.succeeded("carol", "10.0.0.1")
    assert blocked_for(throttle, "carol", "10.0.0.1") is None
    for _ in range(USER_FREE_FAILURES):
        throttle.attempt("dave", None)
    assert blocked_for(throttle, "dave", None) is not None
    clock.now += FIRST_BLOCK_S + FORGET_AFTER_S + 1
    for _ in range(USER_FREE_FAILURES - 1):
        assert blocked_for(throttle, "dave", None) is None


def test_an_address_spraying_many_names_is_blocked() -> None:
    throttle = LoginThrottle(Clock())
    for i in range(ADDRESS_FREE_FAILURES):
        assert blocked_for(throttle, f"user{i}", "10.9.9.9") is None
    assert blocked_for(throttle, "someone-else", "10.9.9.9") == FIRST_BLOCK_S
    assert blocked_for(throttle, "someone-else", "10.9.9.8") is None


def fail_until_the_address_blocks(clock: Clock, throttle: LoginThrottle, user: str,
                                  address: str) -> None:
    """`user` fails from `address` until the address is blocked, waiting out each block of the
    user (a person retrying now and then, or a script that is patient)."""
    for _ in range(ADDRESS_FREE_FAILURES):
        while (wait := blocked_for(throttle, user, address)) is not None:
            clock.now += wait
    assert blocked_for(throttle, "someone-else", address) is not None


def test_a_success_clears_its_users_failures_from_the_address() -> None:
    """Issue 31 §6: a right password after 20 failures from an address left it blocked (the
    attempt was charged first, the success refunded only that one charge)."""
    clock = Clock()
    throttle = LoginThrottle(clock)
    fail_until_the_address_blocks(clock, throttle, "carol", "10.0.0.1")
    clock.now += MAX_BLOCK_S  # every block has run out
    throttle.attempt("carol", "10.0.0.1")  # the right password, this time
    throttle.succeeded("carol", "10.0.0.1")
    # The address is free again, and its count started over (each name fails once).
    for i in range(ADDRESS_FREE_FAILURES - 1):
        assert blocked_for(throttle, f"dave{i}", "10.0.0.1") is None


def test_a_guesser_with_an_account_cannot_clear_the_address_by_logging_in() -> None:
    clock = Clock()
    throttle = LoginThrottle(clock)
    for i in range(ADDRESS_FREE_FAILURES):
        assert blocked_for(throttle, f"victim{i}", "10.6.6.6") is None
    clock.now += FIRST_BLOCK_S
    throttle.attempt("mallory", "10.6.6.6")  # mallory's own, right password
    throttle.succeeded("mallory", "10.6.6.6")
    assert blocked_for(throttle, "victim0", "10.6.6.6") is not None  # the spray still counts
