"""Failed logins, counted per user name and per client address, in memory.

Each key (a user name, an address) has a streak of failures. The first few are free; from then
on every failure blocks the key for twice as long as the one before (30 s, 60 s, … up to 15 min),
and a blocked key is refused (429 with Retry-After) before its password is even checked. A streak
is forgotten after 15 quiet minutes.

An attempt is charged *before* the password is checked, so a burst of parallel guesses cannot
all slip in before the first failure is counted. A successful login clears its user's streak,
and takes back from its address every failure charged there for that user (the attempt that
succeeded included): refunding only that attempt left an address blocked again by the very
login that proved its user. What other names failed from that address stays counted, so a
guesser who owns one account cannot clear the address by logging in to it. Addresses get a
larger allowance than users: one address may be a NAT, or every local browser (loopback).
The clock is injected so the policy is tested without sleeping.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from modelyard.errors import TooManyAttempts

USER_FREE_FAILURES = 5
ADDRESS_FREE_FAILURES = 20
FIRST_BLOCK_S = 30.0
MAX_BLOCK_S = 900.0
FORGET_AFTER_S = 900.0
_MAX_KEYS = 100_000  # a flood of made-up names cannot grow the table without bound
# Names whose failures an address remembers (to refund them on a success); past this, a new
# name's failures still count but are never refunded. A sprayer is blocked long before.
_MAX_NAMES_PER_ADDRESS = 1_000


@dataclass
class _Streak:
    failures: int = 0
    last_at: float = 0.0
    blocked_until: float = 0.0
    by_user: dict[str, int] = field(default_factory=dict)  # an address's failures per name


class LoginThrottle:
    blocking = False  # in memory: called on the event loop (the check and charge are atomic)

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._streaks: dict[tuple[str, str], _Streak] = {}

    def _keys(self, user: str, address: str | None) -> list[tuple[tuple[str, str], int]]:
        keys = [(("user", user.lower()), USER_FREE_FAILURES)]
        if address:
            keys.append((("address", address), ADDRESS_FREE_FAILURES))
        return keys

    def _streak(self, key: tuple[str, str], now: float) -> _Streak:
        streak = self._streaks.get(key)
        if streak is not None and now - max(streak.last_at, streak.blocked_until) > FORGET_AFTER_S:
            streak = None
        if streak is None:
            if len(self._streaks) >= _MAX_KEYS:
                self._forget_quiet(now)
            streak = self._streaks[key] = _Streak()
        return streak

    def _forget_quiet(self, now: float) -> None:
        self._streaks = {k: s for k, s in self._streaks.items()
                         if now - max(s.last_at, s.blocked_until) <= FORGET_AFTER_S}

    def attempt(self, user: str, address: str | None) -> None:
        """Charges one failure to the user and the address, or raises TooManyAttempts (and
        charges nothing) while either is blocked."""
        now = self.clock()
        keys = self._keys(user, address)
        wait = max(self._streak(key, now).blocked_until - now for key, _ in keys)
        if wait > 0:
            raise TooManyAttempts(
                f"too many failed logins for this user or from this address; try again in "
                f"{math.ceil(wait)} s", retry_after_s=math.ceil(wait))
        name = user.lower()
        for key, free in keys:
            streak = self._streak(key, now)
            streak.failures += 1
            streak.last_at = now
            if key[0] == "address" and (name in streak.by_user
                                        or len(streak.by_user) < _MAX_NAMES_PER_ADDRESS):
                streak.by_user[name] = streak.by_user.get(name, 0) + 1
            if streak.failures >= free:
                block = FIRST_BLOCK_S * 2 ** (streak.failures - free)
                streak.blocked_until = now + min(MAX_BLOCK_S, block)

    def succeeded(self, user: str, address: str | None) -> None:
        """The password was right: the user's streak ends, and the address forgets what it
        was charged for this user (this attempt too); it is unblocked unless other names'
        failures alone still exceed its allowance."""
        name = user.lower()
        self._streaks.pop(("user", name), None)
        streak = self._streaks.get(("address", address)) if address else None
        if streak is not None:
            streak.failures = max(0, streak.failures - streak.by_user.pop(name, 0))
            if streak.failures < ADDRESS_FREE_FAILURES:
                streak.blocked_until = 0.0
